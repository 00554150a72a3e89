"""The run layout cuDNN's packed attention gets (jaxppo/models/transformer.py: `segment_runs`,
`ragged_layout`; jaxppo/packing.py: `segment_starts`) says exactly what the [t, t] mask says.

cuDNN itself needs a GPU (its parity with the mask path is checked on the H200 by
scripts/bench_packing.py); here the layout is checked: the attention pattern implied by (seqlen,
offsets), causal within each run, equals `attention_mask_4d` for every valid query, and every column
lies in exactly one run (no output left unwritten)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.models.transformer import attention_mask_4d, ragged_layout, segment_runs
from jaxppo.packing import attention_windows, pack
from jaxppo.plan_search import window_allowance
from tests.test_packing import P, R, random_batch


def implied_mask(lens: np.ndarray, offsets: np.ndarray, t: int, windows: int = 1) -> np.ndarray:
    """[b, t, t] causal-within-run pattern of cuDNN's packed layout over rows cut into `windows` windows (entry
    e = row * windows + j of `lens` / `offsets` is window j of its row, offsets from the window's first column), as
    cuDNN reads it: each run from its offset in the flat buffer, at most a window long (float64-free: integers)."""
    w = t // windows
    b = lens.shape[0] // windows
    run = np.full((b, t), -1)
    for e in range(lens.shape[0]):
        i, j = divmod(e, windows)
        for s, (n, o) in enumerate(zip(lens[e], offsets[e])):
            if n >= 0:
                assert 0 <= o < w and 0 < n <= w, "a run cuDNN cannot read: offset outside its window, or longer"
                a = j * w + o
                assert a + n <= t and (run[i, a:a + n] == -1).all(), "runs overlap, or leave the row"
                run[i, a:a + n] = e * lens.shape[1] + s
    assert (run >= 0).all(), "a column in no run"
    causal = np.tril(np.ones((t, t), bool))
    return (run[:, :, None] == run[:, None, :]) & causal[None]


def check(segment_ids: np.ndarray, starts) -> None:
    t = segment_ids.shape[1]
    lens, offsets = (np.asarray(x) for x in ragged_layout(jnp.asarray(starts), t))
    windows = 1 if np.ndim(starts) == 2 else np.shape(starts)[1]
    assert lens.shape == (segment_ids.shape[0] * windows, np.shape(starts)[-1])
    assert lens.shape[1] + 1 == offsets.shape[1] and (offsets[:, -1] == -1).all()
    got = implied_mask(lens, offsets, t, windows)
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


def test_rows_cut_into_attention_windows_match_mask():
    """Rows of several windows (`window`: the longest sequence): runs listed by the window they start in, a run
    going on into the next window, the unused tail cut at each window's start; the pattern cuDNN reads from that
    is the mask's, and no run is longer than a window (what cuDNN's layout allows)."""
    crossed = 0
    for seed in range(6):
        batch = random_batch(101, 24, seed=seed)
        window = batch["input_ids"].shape[1]  # the engine's padded width: the longest a sequence can be
        packed = pack(batch, R, budget=8 * window, shards=2, window=window)
        seg = packed.arrays["attention_mask"].reshape(-1, packed.arrays["attention_mask"].shape[-1])
        starts = packed.arrays["segment_starts"]
        k = starts.shape[2]
        t = seg.shape[1]
        assert k == attention_windows(t, 8 * window, window) and k > 1, (t, k)
        starts = starts.reshape(seg.shape[0], k, -1)
        check(seg, starts)
        # a sequence that starts in one window and ends in the next
        w = t // k
        lens, offsets = (np.asarray(x) for x in ragged_layout(jnp.asarray(starts), t))
        crossed += int(((offsets[:, :-1] >= 0) & (offsets[:, :-1] + lens > w)).sum())
        # no window holds more runs than the plan allows for it at the data's shortest prompt
        shortest = int((batch["attention_mask"][:, :P] > 0).sum(1).min())
        assert starts.shape[-1] >= 2 and ((starts >= 0).sum(-1) <= window_allowance(w, shortest, 12)).all()
    assert crossed > 0


def test_a_row_of_one_window_keeps_its_layout():
    """Without `window`, in a row shorter than two windows, or at a budget whose rows share no window length (not a
    multiple of 8): one window, the runs of the row as before."""
    batch = random_batch(101, 16, seed=3)
    window = batch["input_ids"].shape[1]
    cases = [dict(budget=8 * window), dict(budget=8 * window, window=window, row_len=window + window // 2),
             dict(budget=8 * window + 4, window=window)]
    for kw in cases:
        packed = pack(batch, R, shards=2, **kw)
        assert packed.arrays["segment_starts"].shape[2] == 1, kw
        kw.pop("window", None)
        assert packed.shape_key == pack(batch, R, shards=2, **kw).shape_key


def emulated_cudnn(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type, qkv_layout):
    """What cuDNN computes from JAX's packed layout, written out: q / k / v [B, T, N, H] are one flat buffer of
    B x T tokens, and each entry's runs (seqlen [B, m], offsets from the entry's first token [B, m + 1], -1: none)
    are read from it at that offset, for as long as the run is (past the entry's T tokens if it is longer there).
    Causal attention within each run (GQA); a token in no run is NaN (cuDNN would leave it unwritten)."""
    B, T, N, H = q.shape
    F = B * T
    start = (q_offsets[:, :-1] + jnp.arange(B)[:, None] * T).reshape(-1)
    n = q_seqlen.reshape(-1)
    ok = (q_offsets[:, :-1].reshape(-1) >= 0) & (n > 0)
    f = jnp.arange(F)
    member = ok[None, :] & (f[:, None] >= start[None, :]) & (f[:, None] < (start + n)[None, :])  # [F, runs]
    run = jnp.where(member.any(-1), jnp.argmax(member, -1), -1)
    allowed = (run[:, None] == run[None, :]) & (run[:, None] >= 0) & (f[None, :] <= f[:, None])
    rep = N // k.shape[2]
    qf, kf, vf = (x.reshape(F, -1, H) for x in (q, k, v))
    kf, vf = jnp.repeat(kf, rep, axis=1), jnp.repeat(vf, rep, axis=1)
    s = jnp.einsum("fnh,gnh->nfg", qf, kf) * scale
    p = jax.nn.softmax(jnp.where(allowed[None], s, -jnp.inf), axis=-1)
    out = jnp.einsum("nfg,gnh->fnh", jnp.nan_to_num(p), vf)
    out = jnp.where((run >= 0)[:, None, None], out, jnp.nan)
    return out.reshape(B, T, N, H).astype(q.dtype)


def test_cudnn_path_on_windows_equals_the_mask(tiny_qwen, monkeypatch):
    """The model's cuDNN path (windowed rows reshaped, the layout JAX hands cuDNN) with cuDNN written out
    (`emulated_cudnn`): hidden states of every real token equal the XLA mask path's, for rows of several windows,
    rows of one, and the engine's unpacked layout. cuDNN itself is checked on a GPU (scripts/bench_packing.py)."""
    import jax._src.cudnn.fused_attention_stablehlo as fa

    from jaxppo.models import build_model, init_params, load_config

    monkeypatch.setattr(fa, "dot_product_attention", emulated_cudnn)
    cfg, _ = load_config(tiny_qwen)
    batch = random_batch(cfg.vocab_size, 12, seed=4)
    window = batch["input_ids"].shape[1]
    xla = build_model(cfg, attention_window=window)
    cudnn = build_model(cfg, attention_impl="cudnn", attention_window=window)
    params = init_params(xla, jax.random.PRNGKey(0))
    rows = dict(budget=8 * window, shards=1, row_len=6 * window)
    cases = {"windows": pack(batch, R, window=window, **rows), "one window": pack(batch, R, **rows)}
    assert cases["windows"].arrays["segment_starts"].shape[2] > 1
    assert cases["one window"].arrays["segment_starts"].shape[2] == 1
    for name, packed in cases.items():
        a = packed.arrays
        for m in range(a["input_ids"].shape[0]):
            args = [jnp.asarray(a[key][m]) for key in ("input_ids", "positions", "attention_mask")]
            want = xla.apply({"params": params}, *args)
            got = cudnn.apply({"params": params}, *args, jnp.asarray(a["segment_starts"][m]))
            real = np.asarray(a["attention_mask"][m]) > 0
            assert np.isfinite(np.asarray(got)[real]).all(), name
            np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5, err_msg=name)
    args = [jnp.asarray(batch[key]) for key in ("input_ids", "positions", "attention_mask")]
    real = batch["attention_mask"] > 0
    np.testing.assert_allclose(np.asarray(cudnn.apply({"params": params}, *args))[real],
                               np.asarray(xla.apply({"params": params}, *args))[real], atol=2e-5)
