"""Rule rewards keyed by `data_source`, safe batch scoring, and reward-model scoring."""

from __future__ import annotations

from jaxppo.rewards import gsm8k, math
from jaxppo.rewards.registry import (ANSWER_EXTRACTORS, REWARD_FUNCTIONS, ScoreResult, get_answer_extractor,
                                     get_reward_fn, score_batch)

__all__ = ["ANSWER_EXTRACTORS", "REWARD_FUNCTIONS", "get_answer_extractor", "ScoreResult", "get_reward_fn", "score_batch", "gsm8k", "math"]
