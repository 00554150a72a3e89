"""`python -m jaxppo.compare`: the same checkpoint and batch in jaxppo (JAX) and transformers (torch).

Subcommands:
  logits (default)  forward pass parity on random left-padded batches.

The last line printed is one JSON object (machine-readable); a table precedes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

SUBCOMMANDS = ("logits",)


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

    jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    head = "value" if _is_score(model_dir) else "lm"
    module, params, cfg = load_model(model_dir, head, dtype=jdtype, param_dtype=jdtype)
    ids, mask, pos = random_left_padded_batch(np.random.default_rng(seed), batch, seq, cfg.vocab_size)

    method = "forward_logits" if head == "lm" else "__call__"
    fwd = jax.jit(lambda p, i, q, s: module.apply({"params": p}, i, q, s, method=method))
    t0 = time.perf_counter()
    ours = np.asarray(jax.block_until_ready(fwd(params, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
                      ).astype(np.float32)
    t_jax = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = hf_logits(load_hf_model(model_dir, dtype, device), ids, mask, pos)
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


def _print_table(report: dict) -> None:
    width = max(len(k) for k in report)
    for k, v in report.items():
        print(f"{k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS + ("-h", "--help"):
        argv.insert(0, "logits")
    parser = argparse.ArgumentParser(prog="python -m jaxppo.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits", help="forward-pass parity with transformers")
    lg.add_argument("--model", required=True, help="Hugging Face model directory")
    lg.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    lg.add_argument("--batch", type=int, default=4)
    lg.add_argument("--seq", type=int, default=32)
    lg.add_argument("--seed", type=int, default=0)
    lg.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the torch model runs")
    args = parser.parse_args(argv)

    from jaxppo.errors import JaxppoError

    try:
        report = logits_report(args.model, args.dtype, args.batch, args.seq, args.seed, args.device)
    except JaxppoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print_table(report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
