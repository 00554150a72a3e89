"""The embedded default learns with rollouts one step ahead (`trainer.async_rollout=true`, jaxppo/ahead.py): each
batch sampled by the weights of the step before, the PPO ratio taken against the sampling policy (verl's bypass
mode, what one step ahead implies when the config names no rollout correction). A file of its own, so that the two
test workers run it beside tests/test_learning.py's synchronous run."""

import pytest

from jaxppo.config import load_config
from tests.train_helpers import ROOT, learns


@pytest.mark.slow
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
