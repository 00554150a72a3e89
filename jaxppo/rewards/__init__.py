"""Rule rewards keyed by `data_source`, safe batch scoring, and reward-model scoring."""

from __future__ import annotations

from jaxppo.rewards import gsm8k, math
from jaxppo.rewards.registry import REWARD_FUNCTIONS, ScoreResult, get_reward_fn, score_batch

__all__ = ["REWARD_FUNCTIONS", "ScoreResult", "get_reward_fn", "score_batch", "gsm8k", "math"]
