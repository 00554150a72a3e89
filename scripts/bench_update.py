"""Actor-update throughput: jaxppo (JAX) vs Hugging Face torch, same shapes, same call.

    python scripts/bench_update.py --model qwen2.5-0.5b,qwen2.5-1.5b --batch 8 --seq 1024 --steps 10 \
        [--remat dots_attn --unroll 0 --head-remat 0] [--torch ckpt,nockpt,compile] [--lora 64] [--loop scan,host]

JAX: `jaxppo.engine.ActorEngine.update` (PPO clipped loss over the response half, chunked log-probs, fp32
master weights + bf16 compute, cuDNN attention on GPU, AdamW). torch: a transformers model in bf16, sdpa
attention, fused AdamW, the same PPO loss on the same response positions (`logits_to_keep`), in up to three
configurations, each in its own process: `ckpt` (gradient checkpointing), `nockpt` (all activations kept:
faster where it fits) and `compile` (torch.compile of the model, no checkpointing). A configuration that
runs out of memory is reported as such. The headline ratio is JAX against the fastest torch configuration
that ran. Random weights of the real shape. `--lora R[,R..]` adds JAX runs with LoRA adapters of rank R
(alpha 2R, every projection; the base frozen in bf16), beside full fine-tuning in the same call: step time,
peak memory and the bytes the train state holds (`state_gb`: trained parameters + AdamW + the frozen base).
`--loop scan,host` runs each JAX configuration with each micro-batch loop (`model.micro_batch_loop`; with
`--micro` below the batch: several micro-batches a step), side by side; `--no-full` leaves full fine-tuning out.

Medians of `--steps` steps after a warm-up step (two for torch.compile). MFU is model FLOPs as computed
(causal attention, the vocabulary head over the response positions only; jaxppo/perf.py) over the card's
specified dense bf16 peak (989 TFLOP/s on an H100 / H200); the measured matmul peak of the same card is
printed beside it. Prints a table, one JSON line per framework and configuration, and appends one
`"bench": "update"` ledger row per model (`--ledger`; `--no-ledger` for smoke tests).
"""

from __future__ import annotations

import argparse
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
from jaxppo.models import build_model, init_params, abstract_params  # noqa: E402
from jaxppo.models.lora import LoraSpec  # noqa: E402
from jaxppo.perf import device_peak_flops, flops_model, measure_matmul_peak, step_flops  # noqa: E402
from jaxppo.sharding import make_mesh, param_shardings  # noqa: E402
from scripts.shapes import SHAPES  # noqa: E402


def synthetic_batch(cfg, batch: int, seq: int, resp: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), np.int32)
    return dict(input_ids=ids, attention_mask=mask, positions=np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
                response_mask=np.ones((batch, resp), np.float32),
                old_logprobs=np.full((batch, resp), -11.0, np.float32),
                advantages=rng.normal(size=(batch, resp)).astype(np.float32))


def bench_jax(cfg, args, batch_np) -> dict:
    from jaxppo.memory import held_bytes
    from jaxppo.models.lora import is_adapter

    mesh = make_mesh({"data": -1})
    impl = "cudnn" if jax.default_backend() == "gpu" else None
    r = args.lora_rank
    lora = dict(lora=LoraSpec(r, 2.0 * r), param_dtype=jnp.bfloat16) if r else dict(param_dtype=jnp.float32)
    module = build_model(cfg, dtype=jnp.bfloat16, remat=args.remat, attention_impl=impl, scan_unroll=args.unroll,
                         **lora)
    params = init_params(module, jax.random.PRNGKey(0), param_shardings(abstract_params(module), mesh))
    acfg = ActorConfig(ppo_micro_batch_size_per_device=args.micro or args.batch // jax.device_count(),
                       logprob_chunk_size=args.chunk, logprob_remat=bool(args.head_remat), optim=OptimConfig(lr=1e-6))
    engine = ActorEngine(module, mesh, acfg, args.seq // 2, trainable=is_adapter if r else None)
    engine.micro_batch_loop = args.loop
    state = engine.init_state(params)
    del params
    state_gb = held_bytes((state.params, state.opt_state, engine.frozen)) / 2**30
    batch = engine.shard_batch(batch_np)
    t0 = time.perf_counter()
    state, m = engine.update(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = engine.update(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    mem = jax.local_devices()[0].memory_stats() or {}
    out = {"step_s": float(np.median(times)), "compile_s": compile_s, "loss": float(m["pg_loss"]),
           "peak_mem_gb": mem.get("peak_bytes_in_use", 0) / 2**30, "state_gb": state_gb, "samples": len(times)}
    if args.profile:  # one more step under the profiler: where the device time goes
        from scripts.trace_summary import print_summary, summarise_latest

        d = Path(args.profile) / f"{args.current}_{args.remat}"
        with jax.profiler.trace(str(d), create_perfetto_trace=True):
            state, m = engine.update(state, batch)
            jax.block_until_ready(m)
        summary = summarise_latest(d, top=40)
        if summary is not None:
            out["profile"] = summary
            print_summary(summary)
    return out


def bench_torch(cfg, args, batch_np) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from scripts.shapes import write_config_dir

    device = "cuda" if torch.cuda.is_available() else "cpu"
    d = write_config_dir(args.current, Path(args.workdir) / args.current)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.bfloat16,
                                             attn_implementation="sdpa").to(device)
    variant = args.torch_variant
    if variant == "ckpt":
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    forward = torch.compile(model) if variant == "compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")
    ids = torch.as_tensor(batch_np["input_ids"], device=device).long()
    resp = args.seq // 2
    targets = ids[:, -resp:]
    old = torch.as_tensor(batch_np["old_logprobs"], device=device)
    adv = torch.as_tensor(batch_np["advantages"], device=device)

    def step():
        logits = forward(input_ids=ids, logits_to_keep=resp + 1).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        ratio = torch.exp(lp - old)
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(2 if variant == "compile" else 1):  # warm-up (compilation)
        step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"step_s": float(np.median(times)), "peak_mem_gb": peak, "samples": len(times)}


def in_subprocess(fw: str, name: str, args, variant: str = "") -> dict:
    """One framework in its own process: each allocator keeps the memory it grew into, so running
    both in one process would leave the second with what the first did not hold."""
    import subprocess

    cmd = [sys.executable, __file__, "--only", fw, "--model", name, "--batch", str(args.batch), "--seq",
           str(args.seq), "--steps", str(args.steps), "--micro", str(args.micro), "--chunk", str(args.chunk),
           "--remat", args.remat, "--unroll", str(args.unroll), "--torch-variant", variant or "ckpt",
           "--head-remat", str(args.head_remat), "--lora-rank", str(getattr(args, "lora_rank", 0)),
           "--loop", getattr(args, "current_loop", "scan"), "--workdir", args.workdir]
    cmd += ["--profile", args.profile] if args.profile else []
    res = subprocess.run(cmd, capture_output=True, text=True)
    lines = res.stdout.splitlines()
    print("\n".join(x for x in lines if not x.startswith(("RESULT ", "device:"))), flush=True)
    found = [x for x in lines if x.startswith("RESULT ")]
    if res.returncode != 0 or not found:
        if "out of memory" in res.stderr.lower() or "OutOfMemory" in res.stderr:
            return {"error": "out of memory"}
        raise RuntimeError(f"{fw} run failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(found[-1][len("RESULT "):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro", type=int, default=0, help="micro-batch per device (0: the whole batch)")
    p.add_argument("--chunk", type=int, default=512, help="log-prob chunk (response tokens)")
    p.add_argument("--remat", default="full")
    p.add_argument("--unroll", type=int, default=1, help="JAX: decoder layers per iteration of the layer scan (0: all)")
    p.add_argument("--head-remat", type=int, default=1,
                   help="JAX: recompute the log-prob chunks' logits in the backward pass (1) or keep them (0)")
    p.add_argument("--torch", default="ckpt,nockpt,compile",
                   help="torch configurations (comma list of ckpt, nockpt, compile; empty: JAX only)")
    p.add_argument("--lora", default="", help="JAX: also run with LoRA adapters of these ranks (comma list)")
    p.add_argument("--loop", default="scan", help="JAX: micro-batch loops to run (comma list of scan, host)")
    p.add_argument("--no-full", action="store_true", help="JAX: LoRA runs only (no full fine-tuning)")
    p.add_argument("--lora-rank", type=int, default=0, help=argparse.SUPPRESS)  # internal
    p.add_argument("--only", choices=["jax", "torch"], default=None, help=argparse.SUPPRESS)  # internal
    p.add_argument("--torch-variant", default="ckpt", help=argparse.SUPPRESS)  # internal
    p.add_argument("--profile", default=None, help="dir: trace one more JAX step and summarise it")
    p.add_argument("--workdir", default="/tmp/jaxppo_bench")
    p.add_argument("--json-out", default=None)
    p.add_argument("--ledger", default=None)
    p.add_argument("--no-ledger", action="store_true")
    args = p.parse_args(argv)
    if args.only is None:
        peak, source = device_peak_flops()
        measured = measure_matmul_peak(reps=50)
        print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}  jax {jax.__version__}  MFU against "
              f"{peak / 1e12:.1f} TFLOP/s per device ({source}); measured bf16 matmul {measured / 1e12:.1f} TFLOP/s")
    rows = []
    variants = [v for v in args.torch.split(",") if v]
    for name in args.model.split(","):
        args.current = name
        cfg = SHAPES[name]
        resp = args.seq // 2
        batch = synthetic_batch(cfg, args.batch, args.seq, resp)
        if args.only:
            args.loop = args.loop.split(",")[0]
            run = bench_jax if args.only == "jax" else bench_torch
            print("RESULT " + json.dumps(run(cfg, args, batch)), flush=True)
            return 0
        tokens = args.batch * args.seq
        flops = step_flops(flops_model(cfg), np.full(args.batch, args.seq), np.full(args.batch, resp))
        results = {}
        loops = args.loop.split(",")
        for rank in ([] if args.no_full else [0]) + [int(x) for x in args.lora.split(",") if x]:
            for loop in loops:
                args.lora_rank, args.current_loop = rank, loop
                key = "jax" + (f":lora{rank}" if rank else "") + (f"+{loop}" if loop != loops[0] else "")
                results[key] = in_subprocess("jax", name, args)
        args.lora_rank, args.current_loop = 0, loops[0]
        for v in variants:
            results[f"torch:{v}"] = in_subprocess("torch", name, args, v)
        jax_remat = args.remat + (f", unroll {args.unroll or 'all'}" if args.unroll != 1 else "") + \
            ("" if args.head_remat else ", head kept")
        labels = {"ckpt": "checkpointing", "nockpt": "no checkpointing", "compile": "torch.compile, no checkpointing"}
        for fw, r in results.items():
            fw_loop = fw.split("+")
            kind = fw_loop[0].split(":")[1] if ":" in fw_loop[0] else ""
            loop = fw_loop[1] if len(fw_loop) > 1 else (loops[0] if fw.startswith("jax") else "")
            lora = f", LoRA r={kind[4:]}" if kind.startswith("lora") else ""
            config = labels.get(kind) or f"remat {jax_remat}{lora}" + (f", {loop} loop" if len(loops) > 1 else "")
            row = {"model": name, "framework": fw.split(":")[0].split("+")[0], "config": config, "batch": args.batch,
                   "seq": args.seq, "device": jax.devices()[0].device_kind, **r}
            if "step_s" in r:
                f = step_flops(flops_model(cfg, lora=LoraSpec(int(kind[4:]), 1.0)), np.full(args.batch, args.seq),
                               np.full(args.batch, resp)) if kind.startswith("lora") else flops
                row.update(tokens_per_s=tokens / r["step_s"], mfu=f / r["step_s"] / (peak * jax.device_count()))
            rows.append(row)
            print(json.dumps(row))
        ran = {fw: r for fw, r in results.items() if fw.startswith("torch") and "step_s" in r}
        figures = {}
        if "step_s" in results.get("jax", {}):
            figures = {"jax_tokens_per_s": tokens / results["jax"]["step_s"], "jax_mfu": rows[-len(results)]["mfu"],
                       "jax_peak_mem_gb": results["jax"]["peak_mem_gb"], "jax_state_gb": results["jax"]["state_gb"]}
        for fw, r in results.items():
            if fw.startswith("jax") and fw != "jax":  # LoRA beside full fine-tuning, other loops
                key = fw[4:].replace("+", "_")
                figures.update({f"jax_{key}_{k}": r[k] for k in ("step_s", "peak_mem_gb", "state_gb") if k in r})
            elif fw != "jax":
                key = fw.split(":")[1]
                figures[f"torch_{key}_tokens_per_s"] = tokens / r["step_s"] if "step_s" in r else r.get("error")
        if ran and "step_s" in results.get("jax", {}):
            best = min(ran, key=lambda k: ran[k]["step_s"])
            figures["torch_best"] = best.split(":")[1]
            figures["jax_over_torch_best"] = ran[best]["step_s"] / results["jax"]["step_s"]
            print(f"{name}: JAX / fastest torch ({labels[figures['torch_best']]}) = {figures['jax_over_torch_best']:.2f}x")
        if not args.no_ledger:
            from scripts import ledger

            row = ledger.make_row("update", figures, samples={"steps": args.steps}, model=name, batch=args.batch,
                                  seq=args.seq, jax_config=jax_remat, peak_tflops=peak / 1e12, micro=args.micro,
                                  loops=loops)
            print(f"ledger: {ledger.append(row, args.ledger)}")
    print(f"\n{'model':14} {'fw':6} {'config':34} {'step_s':>8} {'tok/s':>10} {'MFU':>6} {'peak GB':>8}")
    for r in rows:
        if "step_s" in r:
            print(f"{r['model']:14} {r['framework']:6} {r['config']:34} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} "
                  f"{r['mfu']:6.1%} {r['peak_mem_gb']:8.1f}")
        else:
            print(f"{r['model']:14} {r['framework']:6} {r['config']:34} {r.get('error')}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
