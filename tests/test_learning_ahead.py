"""The embedded default learns with rollouts one step ahead (`trainer.async_rollout=true`, jaxppo/ahead.py): each
batch sampled by the weights of the step before, the PPO ratio taken against the sampling policy (verl's bypass
mode, what one step ahead implies when the config names no rollout correction). Extended runs
(`JAXPPO_TEST_EXTENDED=1 bash scripts/test.sh tests/test_learning_ahead.py`): the 40-step run took 300-317 s of CI's
2-core suite (2026-12-06, about a tenth of its test-seconds) and kept CI over 30 minutes. What CI keeps of the path:
tests/test_ahead.py (with the lag removed the ahead path trains step for step as the synchronous step; a stale batch
is generated again by a run resumed on-policy), tests/test_operability.py (stopped and resumed exactly with a batch
in flight), tests/test_bench_scripts.py (`compare_modes.py`)."""

import numpy as np
import pytest

from jaxppo.config import load_config
from tests.train_helpers import ROOT, learns


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(1500)
def test_default_learns_one_step_ahead(tmp_path_factory):
    """Seen (docs/benchmarks/learning/cpu_async_vs_sync_2026-12-02, AMD EPYC with AVX-512, five seeds, bypass mode):
    the training score rose 0.065-0.185 from steps 1-10 to 31-40; the synchronous run's rose 0.08-0.20 there. On an
    AMD EPYC without AVX-512 (2026-12-03, this test): 0.273 -> 0.350, validation 0.352 -> 0.543, 124 s of steps."""
    steps = load_config(ROOT / "configs" / "default.yaml").trainer.total_training_steps // 2
    first, last, early, late = learns(tmp_path_factory, "default.yaml", steps, "trainer.async_rollout=true")
    assert first > 0.2, first
    assert late >= early + 0.04, (early, late)
    assert last >= first, (first, last)  # validation does not fall


SEEDS = (0, 1, 2, 3, 4)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(4800)
def test_one_step_ahead_ends_within_005_of_the_synchronous_run_over_five_seeds(tmp_path_factory):
    """The embedded default to its last step (80) synchronously and one step ahead, seeds 0-4 (trainer.seed and
    data.seed; the same warm start for both runs of a seed, the two runs at once): on the mean of the five seeds,
    one step ahead's validation at step 80 ends within 0.05 of the synchronous run's, and its training score over
    steps 71-80 within 0.05 too. Per seed it is not: one greedy validation of 256 problems moves by more than 0.05
    between neighbouring checkpoints of one run (docs/benchmarks/learning/cpu_async_vs_sync_2026-12-02). An extended
    run (33 min on a 2-core AMD EPYC with AVX-512, ~70 min on one without); prints each seed's figures. Passed at
    6598622 on the AVX-512 machine (2026-12-07): validation 0.689 synchronous against 0.655 one step ahead, training
    score 0.481 against 0.454, every figure equal to 703f442's (docs/benchmarks/learning/cpu_async_vs_sync_2026-12-07).
    Failed on the machine without AVX-512, whose CPU code rounds differently from the warm start on: at 25072f3
    0.667 against 0.604, training score 0.481 against 0.437 (2026-12-04); at aa7b143, seeds 0-3, 0.676 against 0.602
    (docs/benchmarks/learning/cpu_async_vs_sync_2026-12-04); at e16db13 (2026-12-07) again 0.667 against 0.604, every
    figure equal to 25072f3's. Over ten seeds there: validation -0.047, training score -0.055 (with AVX-512: -0.025,
    -0.035; docs/benchmarks/learning/cpu_async_vs_sync_noavx512_2026-12-07). The gap sits on the 0.05 the issue asks."""
    import json

    from tests.train_helpers import read_metrics, seed_warm_start, shared_tmp, start_train

    steps = load_config(ROOT / "configs" / "default.yaml").trainer.total_training_steps
    results = {}
    for seed in SEEDS:
        common = [f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps // 2}", "trainer.save_freq=-1",
                  "trainer.logger=[jsonl]", f"trainer.seed={seed}", f"data.seed={seed}"]
        runs = {}
        for ahead in (False, True):
            run = tmp_path_factory.mktemp(f"seed{seed}_ahead_{ahead}") / "run"
            seed_warm_start(run, shared_tmp(tmp_path_factory), *common, config=ROOT / "configs" / "default.yaml")
            runs[ahead] = (run, start_train(run, *common, f"trainer.async_rollout={str(ahead).lower()}",
                                            optimized=True))
        for ahead, (run, proc) in runs.items():
            assert proc.wait(timeout=1800) == 0, (seed, ahead)
            m = read_metrics(run)
            score = [m[s]["critic/score/mean"] for s in range(steps - 9, steps + 1)]
            results[seed, ahead] = {"val_step0": m[0]["val/score"], "val_mid": m[steps // 2]["val/score"],
                                    "val_end": m[steps]["val/score"], "train_score_last10": sum(score) / 10}
            print(json.dumps({"seed": seed, "async_rollout": ahead, **results[seed, ahead]}), flush=True)
    mean = {(ahead, k): np.mean([results[s, ahead][k] for s in SEEDS]) for ahead in (False, True)
            for k in ("val_end", "train_score_last10")}
    print(json.dumps({f"mean_{k}_{'ahead' if a else 'sync'}": v for (a, k), v in mean.items()}), flush=True)
    assert mean[True, "val_end"] >= mean[False, "val_end"] - 0.05, mean
    assert mean[True, "train_score_last10"] >= mean[False, "train_score_last10"] - 0.05, mean
    # both learn: each path's mean validation rises from step 0
    assert all(mean[a, "val_end"] > np.mean([results[s, a]["val_step0"] for s in SEEDS]) + 0.1 for a in (False, True))
