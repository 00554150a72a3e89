"""Reward shaping applied to the scores of a batch (DAPO's overlong penalty) and group filtering (DAPO's dynamic
sampling), as verl's DAPO recipe defines them."""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths: np.ndarray, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> np.ndarray:
    """min(-(length - (R - buffer)) / buffer * factor, 0) per response: 0 up to R - buffer tokens, then falling
    linearly to -factor at R (verl's DAPORewardManager)."""
    expected = max_response_length - buffer_len
    exceed = np.asarray(lengths, np.float64) - expected
    return np.minimum(-exceed / buffer_len * penalty_factor, 0.0)


def groups_with_signal(metric: np.ndarray, prompt_index: np.ndarray) -> np.ndarray:
    """The prompts (indices into the round's prompts, sorted) whose samples do not all share one `metric` value,
    or that have a single sample (verl: std > 0 or one sample)."""
    keep = []
    for p in np.unique(prompt_index):
        values = metric[prompt_index == p]
        if len(values) == 1 or np.std(values) > 0:
            keep.append(int(p))
    return np.asarray(keep, np.int64)
