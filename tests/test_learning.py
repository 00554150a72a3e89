"""The embedded defaults learn: validation rises from the first measurement (step 0, taken after the warm
start). PPO (configs/default.yaml, constant lr after a 20-step warm-up): its first quarter must lift the score by
0.1 (the full CPU run: 0.27 -> 0.41 at step 20 -> 0.66 at 80). GRPO (configs/default_grpo.yaml, no critic; its whole run
takes less time than PPO's): three quarters of its steps must lift it by half. The warm start is built once per test run
(`seed_warm_start`): both configs and the LoRA test share it."""

import pytest

from jaxppo.config import load_config
from tests.train_helpers import ROOT, read_metrics, run_train, seed_warm_start, shared_tmp


def learns(tmp_path_factory, config: str, steps: int) -> tuple[float, float]:
    run = tmp_path_factory.mktemp("learn") / "run"
    args = [f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.save_freq=-1",
            "trainer.logger=[jsonl]"]
    seed_warm_start(run, shared_tmp(tmp_path_factory), *args, config=ROOT / "configs" / config)
    run_train(run, *args, timeout=1200, config=ROOT / "configs" / config)
    metrics = read_metrics(run)
    return metrics[0]["val/score"], metrics[steps]["val/score"]


@pytest.mark.slow
def test_default_learns_in_a_quarter_of_its_steps(tmp_path_factory):
    steps = load_config(ROOT / "configs" / "default.yaml").trainer.total_training_steps // 4
    first, last = learns(tmp_path_factory, "default.yaml", steps)
    assert first > 0.1, first  # the warm start taught the answer format
    assert last >= first + 0.1, (first, last)  # 256 validation prompts: 26 more answered right


@pytest.mark.slow
def test_grpo_default_learns(tmp_path_factory):
    cfg = load_config(ROOT / "configs" / "default_grpo.yaml")
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n >= 4
    # the first three quarters of its run (constant lr after the warm-up: the same steps as the whole run's;
    # the whole run: 0.27 -> 0.47 at step 60 -> 0.59 at 80)
    first, last = learns(tmp_path_factory, "default_grpo.yaml", cfg.trainer.total_training_steps * 3 // 4)
    assert first > 0.1, first
    assert last >= 1.5 * first and last >= first + 0.1, (first, last)
