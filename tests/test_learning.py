"""The embedded default learns: its validation score rises from the first measurement (after the warm
start). The full default (README) runs `trainer.total_training_steps` steps and must end at least 2x its
first score and >= 0.5; here a third of the steps must give a proportionate share of that gain."""

import pytest

from jaxppo.config import load_config
from tests.train_helpers import ROOT, read_metrics, run_train

DEFAULT = load_config(ROOT / "configs" / "default.yaml")


@pytest.mark.slow
def test_default_learns_in_a_third_of_its_steps(tmp_path):
    steps = DEFAULT.trainer.total_training_steps // 3
    run = tmp_path / "run"
    run_train(run, f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.save_freq=-1",
              "trainer.logger=[jsonl]", timeout=900)
    metrics = read_metrics(run)
    first, last = metrics[0]["val/score"], metrics[steps]["val/score"]
    # full run: last >= 2 x first; a third of the run: at least a third of that relative gain
    assert last >= first * (1 + 1 / 3), (first, last)
    assert last > first + 0.05, (first, last)
