"""LoRA's reference log-probs: the base module on the frozen weights (`ActorEngine.ref_logprobs`) against the
actor's forward with the adapters zeroed (what the reference ran before), timed side by side in one process.

Random weights of a real shape, LoRA of the 7B config (rank 64 on every projection, bf16 base), padded rows of
`--seq` tokens of which `--resp` are the response, `--rows` of them in micro-batches of `--micro` rows: the
forward phase of a step of configs/gsm8k_qwen2.5_7b_lora.yaml (256 sequences of ~336 tokens). Medians of
`--repeats` calls after two warm-up calls each; MFU against the card's spec peak from the forward's model FLOPs
(jaxppo.perf). From the repo root:

    python scripts/bench_lora_reference.py --shape qwen2.5-7b [--ledger docs/benchmarks/results.jsonl]
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from jaxppo.models.lora import LoraSpec, is_adapter, zeros_like_adapters  # noqa: E402
from jaxppo.perf import device_peak_flops, flops_model, step_flops  # noqa: E402
from jaxppo.sharding import make_mesh, param_shardings  # noqa: E402
from scripts.bench_update import synthetic_batch  # noqa: E402
from scripts.shapes import SHAPES  # noqa: E402


def timed(fn, repeats: int) -> tuple[list[float], np.ndarray]:
    """(seconds of each of `repeats` calls after two warm-up calls, the last call's result)."""
    for _ in range(2):
        jax.block_until_ready(fn())
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        seconds.append(time.perf_counter() - t0)
    return seconds, np.asarray(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--lora", type=int, default=64)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--micro", type=int, default=64, help="rows per forward micro-batch")
    p.add_argument("--seq", type=int, default=336)
    p.add_argument("--resp", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--ledger", default=None, help="append a `lora_reference` row to this ledger (scripts/ledger.py)")
    args = p.parse_args(argv)

    cfg = SHAPES[args.shape]
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    gpu = jax.default_backend() == "gpu"
    module = build_model(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, remat="dots_attn",
                         attention_impl="cudnn" if gpu else None, scan_unroll=0,
                         lora=LoraSpec(args.lora, 2.0 * args.lora))
    params = init_params(module, jax.random.PRNGKey(0), param_shardings(abstract_params(module), mesh))
    acfg = ActorConfig(log_prob_micro_batch_size_per_device=args.micro, ppo_micro_batch_size_per_device=args.micro,
                       logprob_chunk_size=args.chunk, optim=OptimConfig(lr=1e-6))
    actor = ActorEngine(module, mesh, acfg, args.resp, trainable=is_adapter)
    state = actor.init_state(params)
    del params
    zeros = zeros_like_adapters(state.params)
    batch = actor.shard_batch(synthetic_batch(cfg, args.rows, args.seq, args.resp))
    zero_adapters, before = timed(lambda: actor.logprobs(zeros, batch)[0], args.repeats)
    base, now = timed(lambda: actor.ref_logprobs(zeros, batch), args.repeats)
    diff = float(np.max(np.abs(before - now)))
    # the base model's forward FLOPs (a training pass is 3 forwards' worth in jaxppo.perf's model)
    flops = step_flops(flops_model(cfg), np.full(args.rows, args.seq), np.full(args.rows, args.resp)) / 3
    peak = device_peak_flops()[0] if gpu else None
    figures = {"shape": args.shape, "lora_rank": args.lora, "rows": args.rows, "seq": args.seq,
               "micro_rows": args.micro,
               "zero_adapters_s": statistics.median(zero_adapters), "base_s": statistics.median(base),
               "zero_adapters_all_s": zero_adapters, "base_all_s": base, "max_abs_diff": diff}
    if peak:
        figures.update(mfu_zero_adapters=flops / figures["zero_adapters_s"] / peak,
                       mfu_base=flops / figures["base_s"] / peak, peak_tflops=peak / 1e12)
    print(f"{args.shape} LoRA r={args.lora}, {args.rows} x {args.seq} tokens in micro-batches of {args.micro} rows: "
          f"reference with zero adapters {figures['zero_adapters_s']:.3f} s, base module {figures['base_s']:.3f} s "
          f"(medians of {args.repeats}); largest difference {diff:.2e}", flush=True)
    if args.ledger:
        from scripts import ledger

        ledger.append(ledger.make_row("lora_reference", figures), args.ledger)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
