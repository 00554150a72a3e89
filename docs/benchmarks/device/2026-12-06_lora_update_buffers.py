"""What the LoRA actor update holds beside its states, buffer by buffer (a compile only: nothing is allocated).

On one H100 the committed 7B LoRA config's update probes (2026-12-06,
raw/ppo_step/*_check10_qwen2.5-7b-lora_20b9162.log) rose ~5.9 GiB per 1024 tokens from ~12.9 GiB at none (1024
tokens: 18.76 GiB, 2048: 24.56, 4096: 36.52), where the forward program has 0.6 GiB at none: a fixed ~13 GiB, about
the size of the layers' bf16 weights (12.2 GiB). This
compiles the same update (the model, LoRA and remat of configs/gsm8k_qwen2.5_7b_lora.yaml, random-weight shapes,
padded rows) at two token counts, prints XLA's temporaries and their fixed part, and lists the largest values of
XLA's buffer assignment beside the arguments (from XLA's dump of the larger compile). From the repo root:

    python docs/benchmarks/device/2026-12-06_lora_update_buffers.py --shape qwen2.5-7b --out DIR [--tokens 1024,2048]

On CPU the program is XLA's CPU one (its bf16 products go through float32 copies), so only a GPU's figures answer the
question; a CPU run checks the script.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def largest_values(text: str, top: int) -> list[tuple[int, str]]:
    """(size, "name: shape") of the `top` largest values of an XLA buffer-assignment dump that are not the program's
    arguments (the temporaries and outputs: what the program adds beside its states)."""
    found = re.findall(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)", text)
    seen, out = set(), []
    for name, size, shape in sorted(found, key=lambda v: -int(v[1])):
        if name.startswith("args_") or name in seen:
            continue
        seen.add(name)
        out.append((int(size), f"{name}: {shape}"))
    return out[:top]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--out", required=True, help="XLA's dump and the summary go here")
    p.add_argument("--tokens", default="1024,2048", help="two token counts per micro-batch (rows of --seq tokens)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lora", type=int, default=64)
    p.add_argument("--remat", default="dots_attn")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--unroll", type=int, default=0, help="model.scan_unroll (0: every layer unrolled, as committed)")
    p.add_argument("--ledger", default=None, help="append an `update_memory` row to this ledger (scripts/ledger.py)")
    p.add_argument("--prevent-cse", action="store_true",
                   help="the layers' remat with prevent_cse=True (build_model's prevent_cse; the model's default False)")
    p.add_argument("--dtype", default="bfloat16", help="compute and base dtype (float32: no bf16 conversions on CPU)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches per mini-batch, each of the token count (the update's scan over them, as the "
                        "config's runs have: 64 sequences in micro-batches of 2048 tokens)")
    p.add_argument("--tie", action="store_true",
                   help="each micro-batch's loss reads the weights through an optimisation barrier tied to its "
                        "micro-batch (an experiment: XLA can then neither take the layers' slices once for all "
                        "micro-batches nor hoist them out of the scan)")
    p.add_argument("--loop", default="scan", choices=("scan", "host"),
                   help="model.micro_batch_loop: the micro-batches in the update's scan, or one program each from "
                        "the host (the largest of its three programs is reported)")
    p.add_argument("--keep-logits", action="store_true",
                   help="actor.logprob_remat=false (the config's: each chunk's logits kept for the backward)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    user_flags = os.environ.get("XLA_FLAGS", "").strip()  # recorded in the ledger row (the dump's are this script's)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={out / 'dump'}"
                               " --xla_dump_hlo_module_re=.*actor_update.*").strip()
    os.environ.setdefault("JAXPPO_PROBE_WITHOUT_AUTOTUNE", "1")  # what the plan's child sets (jaxppo/programs.py)
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp

    from jaxppo.build import abstract_of
    from jaxppo.config import ActorConfig, OptimConfig
    from jaxppo.engine import ActorEngine
    from jaxppo.models import build_model
    from jaxppo.models.lora import LoraSpec, is_adapter, split
    from jaxppo.sharding import make_mesh
    from scripts.bench_update import synthetic_batch
    from scripts.shapes import SHAPES

    cfg = SHAPES[args.shape]
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    impl = "cudnn" if jax.default_backend() == "gpu" else None
    dtype = jnp.dtype(args.dtype)
    module = build_model(cfg, dtype=dtype, param_dtype=dtype, remat=args.remat, attention_impl=impl,
                         scan_unroll=args.unroll, lora=LoraSpec(args.lora, 2.0 * args.lora),
                         prevent_cse=args.prevent_cse)
    params = abstract_of(module, mesh)
    _, base = split(params, is_adapter)  # the frozen base: the layers' weights without their adapters
    layers = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(base)
                 if x.ndim == 3 and x.shape[0] == cfg.num_hidden_layers)
    temps = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows = tokens // args.seq
        acfg = ActorConfig(ppo_micro_batch_size_per_device=rows, logprob_chunk_size=args.chunk,
                           logprob_remat=not args.keep_logits, optim=OptimConfig(lr=1e-6))
        engine = ActorEngine(module, mesh, acfg, args.seq // 2, trainable=is_adapter)
        engine.micro_batch_loop = args.loop
        if args.tie:
            loss = engine._loss

            def tied(params, mb, num_tokens, num_seqs, extra=None, loss=loss):
                (params, extra), mb = jax.lax.optimization_barrier(((params, extra), mb))
                return loss(params, mb, num_tokens, num_seqs, extra)

            engine._loss = tied
        state, frozen = engine.abstract_state(params)
        batch = engine.shard_batch(synthetic_batch(cfg, rows * args.micro_batches, args.seq, args.seq // 2))
        mem = engine.compile_update(state, batch, frozen, probe=True)  # on a GPU as the plan's probes compile
        temps[tokens] = mem.temps
        print(f"{args.shape} LoRA r={args.lora} remat={args.remat} unroll={args.unroll} "
              f"prevent_cse={args.prevent_cse} micro-batches={args.micro_batches} keep_logits={args.keep_logits} "
              f"tie={args.tie} loop={args.loop}, {tokens} tokens ({rows} x {args.seq}): "
              f"temporaries {mem.temps / 2**30:.2f} GiB, "
              f"arguments {mem.arguments / 2**30:.2f}, outputs {mem.outputs / 2**30:.2f}",
              flush=True)
    (a, ta), (b, tb) = sorted(temps.items())[:2]
    slope = (tb - ta) / (b - a)
    dumps = sorted((out / "dump").glob("*buffer-assignment.txt"), key=lambda f: f.stat().st_size)
    largest = largest_values(dumps[-1].read_text(), args.top) if dumps else []
    if largest:
        print(f"largest values beside the arguments, {dumps[-1].name}:")
        for size, what in largest:
            print(f"  {size / 2**30:7.2f} GiB  {what}")
    # last, so that a log's tail shows it
    print(f"fixed part of the temporaries: {(ta - slope * a) / 2**30:.2f} GiB; per 1024 tokens "
          f"{slope * 1024 / 2**30:.2f} GiB; the layers' stacked base weights: {layers / 2**30:.2f} GiB")
    if args.ledger:
        from scripts import ledger

        gib = 2**30
        figures = {"shape": args.shape, "lora_rank": args.lora, "remat": args.remat, "scan_unroll": args.unroll,
                   "dtype": args.dtype, "prevent_cse": args.prevent_cse, "micro_batches": args.micro_batches,
                   "keep_logits": args.keep_logits, "tie": args.tie, "loop": args.loop,
                   "xla_flags": user_flags,
                   "temps_gb": {str(k): v / gib for k, v in sorted(temps.items())},
                   "fixed_gb": (ta - slope * a) / gib, "per_1024_tokens_gb": slope * 1024 / gib,
                   "layer_weights_gb": layers / gib, "largest_values": [[s / gib, w] for s, w in largest[:8]]}
        ledger.append(ledger.make_row("update_memory", figures), args.ledger)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
