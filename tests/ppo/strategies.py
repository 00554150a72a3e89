"""Hypothesis inputs: random shapes, random masks with fully masked rows and one-token responses."""

import numpy as np
from hypothesis import strategies as st


@st.composite
def batches(draw, max_b=6, max_t=9):
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["random", "right_padded", "one_token", "some_rows_empty", "full"]))
    if kind == "random":
        mask = (rng.random((b, t)) < 0.7).astype(np.float64)
    elif kind == "right_padded":
        lens = rng.integers(0, t + 1, size=b)
        mask = (np.arange(t)[None] < lens[:, None]).astype(np.float64)
    elif kind == "one_token":
        mask = np.zeros((b, t))
        mask[:, 0] = 1
    elif kind == "some_rows_empty":
        mask = (rng.random((b, t)) < 0.8).astype(np.float64)
        mask[rng.random(b) < 0.5] = 0
    else:
        mask = np.ones((b, t))
    return rng, mask
