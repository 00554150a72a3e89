"""The run layout cuDNN's packed attention gets (jaxppo/models/transformer.py: `segment_runs`,
`ragged_layout`; jaxppo/packing.py: `segment_starts`) says exactly what the [t, t] mask says.

cuDNN itself needs a GPU (its parity with the mask path is checked on the H200 by
scripts/bench_packing.py); here the layout is checked: the attention pattern implied by (seqlen,
offsets), causal within each run, equals `attention_mask_4d` for every valid query, and every column
lies in exactly one run (no output left unwritten)."""

import numpy as np
import jax.numpy as jnp

from jaxppo.models.transformer import attention_mask_4d, ragged_layout, segment_runs
from jaxppo.packing import pack
from tests.test_packing import P, R, random_batch


def implied_mask(lens: np.ndarray, offsets: np.ndarray, t: int) -> np.ndarray:
    """[b, t, t] causal-within-run pattern of cuDNN's packed layout (float64-free: plain integers)."""
    b = lens.shape[0]
    run = np.full((b, t), -1)
    for i in range(b):
        for j, (n, o) in enumerate(zip(lens[i], offsets[i])):
            if n >= 0:
                assert o >= 0 and (run[i, o:o + n] == -1).all(), "runs overlap"
                run[i, o:o + n] = j
    assert (run >= 0).all(), "a column in no run"
    causal = np.tril(np.ones((t, t), bool))
    return (run[:, :, None] == run[:, None, :]) & causal[None]


def check(segment_ids: np.ndarray, starts) -> None:
    t = segment_ids.shape[1]
    lens, offsets = (np.asarray(x) for x in ragged_layout(jnp.asarray(starts), t))
    assert lens.shape[1] + 1 == offsets.shape[1] and (offsets[:, -1] == -1).all()
    got = implied_mask(lens, offsets, t)
    want = np.asarray(attention_mask_4d(jnp.asarray(segment_ids)))[:, 0]
    valid = segment_ids > 0
    np.testing.assert_array_equal(got[valid], want[valid])  # padding queries: outputs unused


def test_unpacked_rows_runs_match_mask():
    batch = random_batch(101, 64, seed=0)
    seg = batch["attention_mask"].copy()
    seg[0] = 0  # an empty row: one run of padding
    seg[1] = 1  # no padding at all: one run
    starts = np.asarray(segment_runs(jnp.asarray(seg)))
    assert starts.shape == (64, 3) and (starts > -2).all()
    check(seg, starts)
    assert (starts[0] == [-1, -1, 0]).all() and (starts[1] == [-1, 0, -1]).all()


def test_unpacked_row_with_a_hole_is_poisoned():
    seg = np.ones((2, 12), np.int32)
    seg[0, 5] = 0  # two runs of tokens: not the engine's layout
    seg[1, :3] = 0  # left padding only: fine
    starts = np.asarray(segment_runs(jnp.asarray(seg)))
    assert (starts[0] == -2).all() and (starts[1] >= -1).all()


def test_packed_rows_runs_match_mask():
    for seed in range(5):
        batch = random_batch(101, 16, seed=seed)
        packed = pack(batch, R, budget=40, shards=2)
        seg = packed.arrays["attention_mask"].reshape(-1, packed.arrays["attention_mask"].shape[-1])
        starts = packed.arrays["segment_starts"].reshape(seg.shape[0], -1)
        assert (seg.max(-1) > 1).any()  # rows really hold several sequences
        check(seg, starts)
        # the run count is the bucket of the largest row's (sequences + a tail, if any)
        n_runs = (starts >= 0).sum(-1)
        assert n_runs.max() <= starts.shape[1]


def test_packed_ids_without_starts_are_poisoned():
    """Segment ids 1, 2 in one row need the packer's starts: derived as one sequence they would be wrong."""
    seg = np.array([[1, 1, 2, 2, 2, 0]], np.int32)
    assert (np.asarray(segment_runs(jnp.asarray(seg))) == -2).all()
