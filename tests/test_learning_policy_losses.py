"""The GRPO embedded default with verl's GSPO loss and with its rollout correction learns (apart from
tests/test_learning.py so that the two test workers share the learning runs)."""

import pytest

from tests.train_helpers import learns


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("method, overrides", [
    # GSPO: the sequence-level ratio, the loss averaged per sequence, verl's recipe's clip range
    ("gspo", ["actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-mean",
              "actor.clip_ratio_low=0.0003", "actor.clip_ratio_high=0.0004"]),
    # rollout correction: token-level truncated IS and token_k1 rejection between the engine and the trainer
    ("rollout_correction", ["algorithm.rollout_correction.rollout_is=token",
                            "algorithm.rollout_correction.rollout_is_threshold=2.0",
                            "algorithm.rollout_correction.rollout_rs=token_k1",
                            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"])])
def test_grpo_default_learns_with_gspo_and_with_rollout_correction(tmp_path_factory, method, overrides):
    """The GRPO embedded default with verl's GSPO loss, and with its rollout correction, learns as GRPO does: the
    training score over the last 10 of 60 steps above the first 10 (the same margin as GRPO's test). Seen (2-core
    x86, 2026-12-02): GSPO 0.276 -> 0.331 (validation 0.367 -> 0.465, a fifth of the tokens clipped at its
    3e-4 / 4e-4 bounds), rollout correction 0.263 -> 0.341 (validation 0.367 -> 0.375)."""
    first, last, early, late = learns(tmp_path_factory, "default_grpo.yaml", 60, *overrides)
    assert first > 0.2, first
    assert late >= early + 0.03, (method, early, late)
    assert last >= first - 0.05, (method, first, last)
