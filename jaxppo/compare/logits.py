"""`compare logits`: forward-pass parity with transformers on random left-padded batches."""

from __future__ import annotations

import time

import numpy as np

from jaxppo.compare.models import jax_dtypes


def random_left_padded_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int):
    """Token ids, attention mask (left padding of random length < seq/2) and HF-style position ids."""
    ids = rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    for row, pad in enumerate(rng.integers(0, max(seq // 2, 1), size=batch)):
        mask[row, :pad] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, positions


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def logits_report(model_dir: str, dtype: str, batch: int, seq: int, seed: int, device: str) -> dict:
    import jax
    import jax.numpy as jnp

    from bridge.reference import hf_logits, load_hf_model
    from jaxppo.models import load_model

    jdtype = jax_dtypes()[dtype]
    head = "value" if _is_score(model_dir) else "lm"
    module, params, cfg = load_model(model_dir, head, dtype=jdtype, param_dtype=jdtype)
    ids, mask, pos = random_left_padded_batch(np.random.default_rng(seed), batch, seq, cfg.vocab_size)

    method = "forward_logits" if head == "lm" else "__call__"
    fwd = jax.jit(lambda p, i, q, s: module.apply({"params": p}, i, q, s, method=method))
    t0 = time.perf_counter()
    ours = np.asarray(jax.block_until_ready(fwd(params, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask))))
    ours = ours.astype(np.float64 if dtype == "float64" else np.float32)
    t_jax = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = hf_logits(load_hf_model(model_dir, dtype, device, inv_freq=cfg.inv_freq()), ids, mask, pos)
    t_torch = time.perf_counter() - t0
    if head == "value":
        theirs = theirs[..., 0]

    valid = mask.astype(bool)
    diff = np.abs(ours - theirs)[valid]
    rel = diff / np.maximum(np.abs(theirs[valid]), 1e-6)
    report = {
        "subcommand": "logits", "model": model_dir, "dtype": dtype, "batch": batch, "seq": seq, "seed": seed,
        "valid_tokens": int(valid.sum()),
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
        "max_rel_logit_diff": float(rel.max()),
        "max_abs_logit": float(np.abs(theirs[valid]).max()),
        "jax_s": round(t_jax, 3), "torch_s": round(t_torch, 3),
    }
    if head == "lm":
        lp_diff = np.abs(_log_softmax(ours) - _log_softmax(theirs))[valid]
        report["max_abs_logprob_diff"] = float(lp_diff.max())
        report["argmax_agreement"] = float((ours.argmax(-1) == theirs.argmax(-1))[valid].mean())
    return report


def _is_score(model_dir: str) -> bool:
    from jaxppo.models import load_config

    return load_config(model_dir)[1] == "score"
