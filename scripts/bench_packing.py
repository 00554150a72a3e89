"""Padded vs packed actor updates on a GSM8K-like length mix: useful (non-padding) tokens per second.

    python scripts/bench_packing.py --model qwen2.5-0.5b,qwen2.5-1.5b --seqs 64 --budget 2048

Lengths: prompts uniform in [60, 200]; responses log-normal (median 110 tokens, sigma 0.6) clipped to
[20, 300], i.e. most answers short, a long tail hitting the cap (`--dist uniform`: responses uniform in
[20, 300]). Padded: prompt left-padded to 200, response right-padded to 300 (500 tokens per sequence),
`--micro` sequences per device per micro-batch. Packed (jaxppo/packing.py): the same sequences in rows of
`--budget` tokens (first-fit decreasing, block-diagonal attention, bucketed shapes). Both do one
`ActorEngine.update` per mini-batch of all `--seqs` sequences (fp32 master weights, bf16 compute, full
remat); median over `--steps`. Prints a table and one JSON line per configuration.

`--attention` (GPU): `cudnn` attends within each sequence through cuDNN's packed (ragged) layout;
`cudnn_mask` is the former layout (cuDNN with a [row, row] mask as a bias), to compare against.
`--check` (first model): log-probs and one update's loss / gradient norm of each attention against XLA's
attention with the dense mask, padded and packed, on the same parameters.
`--lora R` trains rank-R adapters on the frozen bf16 base (the 7B LoRA configs' update, with `--loop host`).
`--chunk 256,2048` times each size of the vocabulary head's chunks (`actor.logprob_chunk_size`: response tokens
of a row per chunk; a packed row's chunk is that many of its response tokens), `--forward` the log-prob pass
(no gradient: the reference's and old policy's) beside each update, and `--dist full` gives the committed GSM8K
configs' batch with random weights (prompts of 77-83 tokens, every response the full 256: random weights never
stop early).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxppo.config import ActorConfig, OptimConfig  # noqa: E402
from jaxppo.engine import ActorEngine  # noqa: E402
from jaxppo.models import abstract_params, build_model, init_params  # noqa: E402
from jaxppo.models.lora import LoraSpec, is_adapter  # noqa: E402
from jaxppo.packing import pack  # noqa: E402
from jaxppo.sharding import make_mesh, param_shardings  # noqa: E402
from scripts.shapes import SHAPES  # noqa: E402

P_MAX, R_MAX = 200, 300


def gsm8k_like_batch(vocab: int, n: int, dist: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    plen = rng.integers(60, P_MAX + 1, n)
    if dist == "full":
        plen, rlen = rng.integers(77, 84, n), np.full(n, 256)
    elif dist == "uniform":
        rlen = rng.integers(20, R_MAX + 1, n)
    else:
        rlen = np.clip(np.round(rng.lognormal(np.log(110), 0.6, n)), 20, R_MAX).astype(int)
    ids = rng.integers(0, vocab, (n, P_MAX + R_MAX)).astype(np.int32)
    mask = np.zeros((n, P_MAX + R_MAX), np.int32)
    for i in range(n):
        mask[i, P_MAX - plen[i]:P_MAX] = 1
        mask[i, P_MAX:P_MAX + rlen[i]] = 1
    rmask = mask[:, P_MAX:].astype(np.float32)
    return dict(input_ids=ids * mask, attention_mask=mask, positions=np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32),
                response_mask=rmask, old_logprobs=np.full((n, R_MAX), -11.0, np.float32) * rmask,
                advantages=rng.normal(size=(n, R_MAX)).astype(np.float32) * rmask)


def timed(engine, state, batch, steps):
    state, m = engine.update(state, batch)  # compile
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = engine.update(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return state, float(np.median(times)), float(m["pg_loss"])


def timed_forward(engine, params, batch, steps) -> float:
    """Median seconds of the log-prob pass (no gradient) over `batch`."""
    jax.block_until_ready(engine.logprobs(params, batch))  # compile
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(engine.logprobs(params, batch))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def profiled(engine, state, batch, forward: bool, out: Path) -> tuple[object, dict]:
    """One more update (and log-prob pass) under JAX's profiler: (the new state, the device ops by time from
    scripts/trace_summary.py)."""
    from scripts.trace_summary import print_summary, summarise_latest

    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        state, m = engine.update(state, batch)
        jax.block_until_ready(m)
        if forward:
            jax.block_until_ready(engine.logprobs(state.params, batch))
    summary = summarise_latest(out, top=30)
    if summary is None:
        return state, {}
    print_summary(summary)
    return state, summary


def check(name: str, engines: dict, params, batch: dict, packed: dict) -> list[dict]:
    """Each attention against XLA's with the dense mask (engines["xla"]), same parameters: max |log-prob
    difference| over response tokens (padded, and each packed layout of `packed`: rows of one attention window,
    rows cut into windows) and one update's pg_loss / grad_norm."""
    m = batch["response_mask"] > 0
    n = m.shape[0]
    out, ref = [], {}
    layouts = ["padded", *packed]
    for impl, engine in engines.items():
        dev = {"padded": engine.shard_batch(batch), **{k: engine.shard_packed(v) for k, v in packed.items()}}
        res = {"lp_padded": np.asarray(engine.logprobs(params, dev["padded"])[0])}
        for layout, v in packed.items():
            res[f"lp_{layout}"] = v.unpack(np.asarray(engine.logprobs(params, dev[layout])[0]), n)
        for layout in layouts:
            _, metrics = engine.update(engine.init_state(jax.tree.map(jnp.copy, params)), dev[layout])
            res[layout] = {k: float(metrics[k]) for k in ("pg_loss", "grad_norm")}
        if impl == "xla":
            ref = res
        row = {"check": impl, "model": name, "against": "xla (dense mask)",
               "windows": {k: int(v.arrays["segment_starts"].shape[2]) for k, v in packed.items()},
               **{f"max_abs_logprob_diff_{layout}": float(np.abs(res[f"lp_{layout}"] - ref[f"lp_{layout}"])[m].max())
                  for layout in layouts},
               "finite": bool(all(np.isfinite(res[f"lp_{layout}"][m]).all() for layout in layouts)),
               **{f"{layout}_{k}": v for layout in layouts for k, v in res[layout].items()},
               **{f"xla_{layout}_{k}": v for layout in layouts for k, v in ref[layout].items()}}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--micro", type=int, default=8, help="padded: sequences per device per micro-batch")
    p.add_argument("--budget", default="2048", help="packed: tokens per row (comma list)")
    p.add_argument("--dist", default="lognormal", choices=["lognormal", "uniform", "full"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--remat", default="full")
    p.add_argument("--attention", default=None, help="comma list: cudnn, cudnn_mask, xla (default: cudnn on GPU)")
    p.add_argument("--check", action="store_true", help="parity of each attention with XLA's (first model)")
    p.add_argument("--windows", default="on", help="packed rows cut into attention windows (jaxppo/packing.py): "
                   "comma list of on, off (each timed)")
    p.add_argument("--chunk", default="512", help="the head's chunk sizes to time (comma list; response tokens a row)")
    p.add_argument("--head-remat", type=int, default=1, help="actor.logprob_remat (0: each chunk's logits kept)")
    p.add_argument("--lora", type=int, default=0, help="LoRA adapters of this rank on every projection, the base "
                   "frozen in bf16 (0: full fine-tuning)")
    p.add_argument("--loop", default="scan", choices=["scan", "host"], help="model.micro_batch_loop (host: the LoRA "
                   "configs' loop)")
    p.add_argument("--forward", action="store_true", help="also time the log-prob pass (no gradient)")
    p.add_argument("--no-padded", action="store_true", help="time the packed layouts only")
    p.add_argument("--profile", default=None, help="dir: trace one more packed update (and log-prob pass) per "
                   "configuration and summarise its device ops (scripts/trace_summary.py)")
    p.add_argument("--ledger", default=None, help="append each timed row (bench `packing`) to this ledger")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    mesh = make_mesh({"data": -1})
    shards = jax.device_count()
    impls = (args.attention or ("cudnn" if jax.default_backend() == "gpu" else "xla")).split(",")
    print(f"device: {jax.devices()[0].device_kind} x{shards}  jax {jax.__version__}")
    rows = []
    chunks = [int(c) for c in args.chunk.split(",")]
    acfg = ActorConfig(ppo_micro_batch_size_per_device=args.micro, log_prob_micro_batch_size_per_device=args.micro,
                       logprob_chunk_size=chunks[0], logprob_remat=bool(args.head_remat), optim=OptimConfig(lr=1e-6))
    lora = dict(lora=LoraSpec(args.lora, 2.0 * args.lora), param_dtype=jnp.bfloat16) if args.lora else \
        dict(param_dtype=jnp.float32)  # LoRA: the base frozen in bf16, as the LoRA configs
    for k, name in enumerate(args.model.split(",")):
        cfg = SHAPES[name]
        build = lambda impl: build_model(cfg, dtype=jnp.bfloat16, remat=args.remat, **lora,  # noqa: E731
                                         attention_impl=None if impl == "xla" else impl, attention_window=P_MAX + R_MAX)
        reference = build("xla")
        params = init_params(reference, jax.random.PRNGKey(0), param_shardings(abstract_params(reference), mesh))
        batch = gsm8k_like_batch(cfg.vocab_size, args.seqs, args.dist)
        useful = int(batch["attention_mask"].sum())
        budgets = [int(b) for b in args.budget.split(",")]
        if args.check and k == 0:
            layouts = {"packed": pack(batch, R_MAX, budgets[-1], shards),
                       "windows": pack(batch, R_MAX, budgets[-1], shards, window=P_MAX + R_MAX)}
            rows += check(name, {i: ActorEngine(build(i), mesh, acfg, R_MAX) for i in ["xla"] + impls}, params, batch,
                          layouts)
        for impl, chunk in [(i, c) for i in impls for c in chunks]:
            engine = ActorEngine(build(impl), mesh, dataclasses.replace(acfg, logprob_chunk_size=chunk), R_MAX,
                                 trainable=is_adapter if args.lora else None)
            engine.micro_batch_loop = args.loop
            state = engine.init_state(jax.tree.map(jnp.copy, params))
            base = {"model": name, "seqs": args.seqs, "dist": args.dist, "useful_tokens": useful, "attention": impl,
                    "remat": args.remat, "logprob_chunk_size": chunk, "lora_rank": args.lora, "loop": args.loop,
                    "logprob_remat": bool(args.head_remat), "device": jax.devices()[0].device_kind}
            t_pad = None
            if not args.no_padded:
                state, t_pad, loss_pad = timed(engine, state, engine.shard_batch(batch), args.steps)
                rows.append({**base, "layout": "padded", "row_tokens": P_MAX + R_MAX, "micro_per_device": args.micro,
                             "step_s": t_pad, "useful_tokens_per_s": useful / t_pad,
                             "computed_tokens": args.seqs * (P_MAX + R_MAX), "pg_loss": loss_pad})
                print(json.dumps(rows[-1]), flush=True)
            for budget in budgets:
                for windows in args.windows.split(","):
                    packed = pack(batch, R_MAX, budget, shards, window=P_MAX + R_MAX if windows == "on" else None)
                    dev = engine.shard_packed(packed)
                    state, t_pack, loss_pack = timed(engine, state, dev, args.steps)
                    n_micro, _, row, runs = packed.shape_key
                    k = packed.arrays["segment_starts"].shape[2]
                    rows.append({**base, "layout": "packed", "budget": budget, "row_tokens": row,
                                 "micro_batches": n_micro, "attention_windows": k,
                                 "runs_per_window": runs, "rows_used": sum(1 for m in packed.members if m),
                                 "step_s": t_pack, "useful_tokens_per_s": useful / t_pack,
                                 "computed_tokens": n_micro * shards * row,
                                 **({"speedup_vs_padded": t_pad / t_pack} if t_pad else {}),
                                 **({"forward_s": timed_forward(engine, state.params, dev, args.steps)}
                                    if args.forward else {}),
                                 "pg_loss": loss_pack, "samples": args.steps})
                    if args.profile:
                        state, rows[-1]["profile"] = profiled(
                            engine, state, dev, args.forward,
                            Path(args.profile) / f"{name}_{impl}_{budget}_{windows}_{chunk}")
                    print(json.dumps(rows[-1]), flush=True)
            del engine, state
        del params
    print(f"\n{'model':14} {'attention':10} {'layout':7} {'budget':>6} {'row':>5} {'windows':>7} {'chunk':>6} "
          f"{'step_s':>8} {'forward_s':>9} {'useful tok/s':>13} {'computed/useful':>16} {'speedup':>8}")
    for r in rows:
        if "step_s" not in r:
            continue
        print(f"{r['model']:14} {r['attention']:10} {r['layout']:7} {r.get('budget', r['row_tokens']):6d} {r['row_tokens']:5d} "
              f"{r.get('attention_windows', 1):7d} {r['logprob_chunk_size']:6d} {r['step_s']:8.3f} "
              f"{r.get('forward_s', float('nan')):9.3f} {r['useful_tokens_per_s']:13.0f} "
              f"{r['computed_tokens'] / r['useful_tokens']:16.2f} {r.get('speedup_vs_padded', 1.0):8.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    if args.ledger:
        from scripts import ledger

        for r in rows:
            ledger.append(ledger.make_row("packing", r), args.ledger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
