"""Reward model: a token-classification checkpoint scored at the last valid token."""

import numpy as np

from bridge.reference import hf_logits, load_hf_model
from jaxppo.rewards.model import RewardModel
from tests.helpers import make_hf_checkpoint


def test_reward_model_scores_last_token(tmp_path):
    path = make_hf_checkpoint(tmp_path / "rm", "qwen2", head="score")
    rm = RewardModel(path)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, rm.cfg.vocab_size, size=(3, 9))
    mask = np.ones((3, 9), np.int64)
    mask[1, :4] = 0  # left padding
    mask[2, 6:] = 0  # right padding: the score is read at position 5
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    ref = hf_logits(load_hf_model(path), ids, mask, pos)[..., 0]
    got = np.asarray(rm.score(ids, mask))
    np.testing.assert_allclose(got, [ref[0, 8], ref[1, 8], ref[2, 5]], atol=1e-4)
