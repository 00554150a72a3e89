"""The same PPO update work under several mesh shapes, one table: step time and its breakdown,
tokens/s, MFU, peak memory per device.

    python scripts/mesh_sweep.py --model qwen2.5-1.5b --meshes "single;data=2;fsdp=2;tensor=2" \
        --batch 16 --seq 1024 --steps 3 [--json-out sweep.json]

A mesh is `axis=size,...` over (data, fsdp, tensor), optionally with `gather=update` (mesh.fsdp_gather:
fsdp shards gathered once per update instead of per layer) and `reduce=bfloat16` (mesh.grad_reduce_dtype);
`single` is one device (the baseline). Each mesh
runs in its own process (clean compile caches and peak-memory counters). Phases, as in one PPO step
(generation and rewards excluded: they do not depend on the mesh): old_log_prob (actor forward),
values (critic forward), update_critic, update_actor: one mini-batch of `--batch` sequences of `--seq`
tokens (half prompt, half response), fp32 master weights, bf16 compute, `--remat`. Median over
`--steps`. MFU: model FLOPs as computed (jaxppo/perf.py) of the actor update over the specified bf16
peak times the devices used. `--actor-only`: the critic's phases are left out (a 7B actor and critic
with fp32 masters and AdamW do not fit on two H200s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_mesh(text: str) -> tuple[dict[str, int], dict[str, str]]:
    """"fsdp=2" or "data=2,fsdp=4,gather=update,reduce=bfloat16" -> (axis sizes, engine options:
    mesh.fsdp_gather, mesh.grad_reduce_dtype)."""
    if text == "single":
        return {"data": 1}, {}
    items = dict(item.split("=") for item in text.split(","))
    opts = {"fsdp_gather": items.pop("gather", "layer"), "grad_reduce_dtype": items.pop("reduce", "float32")}
    return {k: int(v) for k, v in items.items()}, opts


def run_one(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxppo.config import ActorConfig, CriticConfig, OptimConfig
    from jaxppo.engine import ActorEngine, CriticEngine
    from jaxppo.models import abstract_params, build_model, init_params
    from jaxppo.perf import device_peak_flops, flops_model, step_flops
    from jaxppo.sharding import make_mesh, param_shardings
    from scripts.bench_update import synthetic_batch
    from scripts.shapes import SHAPES

    shape, opts = parse_mesh(args.one)
    n_dev = int(np.prod(list(shape.values())))
    mesh = make_mesh(shape, devices=jax.devices()[:n_dev])
    cfg = SHAPES[args.model]
    impl = "cudnn" if jax.default_backend() == "gpu" else None
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=args.remat, attention_impl=impl)
    actor_mod, critic_mod = build_model(cfg, **kw), build_model(cfg, "value", **kw)
    a_params = init_params(actor_mod, jax.random.PRNGKey(0), param_shardings(abstract_params(actor_mod), mesh))
    c_params = None if args.actor_only else init_params(critic_mod, jax.random.PRNGKey(1),
                                                        param_shardings(abstract_params(critic_mod), mesh))
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = args.micro_per_device or max(args.batch // shards // args.micro_batches, 1)
    resp = args.seq // 2
    optim = OptimConfig(lr=1e-6)
    actor = ActorEngine(actor_mod, mesh, ActorConfig(ppo_micro_batch_size_per_device=micro,
                                                     log_prob_micro_batch_size_per_device=micro,
                                                     logprob_chunk_size=512, optim=optim), resp, **opts)
    critic = CriticEngine(critic_mod, mesh, CriticConfig(ppo_micro_batch_size_per_device=micro,
                                                         log_prob_micro_batch_size_per_device=micro, optim=optim), resp,
                          **opts)
    host = synthetic_batch(cfg, args.batch, args.seq, resp)
    host.update(values=np.zeros((args.batch, resp), np.float32), returns=np.ones((args.batch, resp), np.float32))
    batch = actor.shard_batch(host)
    state = {"a": actor.init_state(a_params), "c": None if args.actor_only else critic.init_state(c_params)}

    def upd_a():
        state["a"], m = actor.update(state["a"], batch)
        return m

    def upd_c():
        state["c"], m = critic.update(state["c"], batch)
        return m

    phases = {"old_log_prob": lambda: actor.logprobs(state["a"].params, batch),
              "values": lambda: critic.values(state["c"].params, batch),
              "update_critic": upd_c, "update_actor": upd_a}
    if args.actor_only:
        phases = {k: v for k, v in phases.items() if k in ("old_log_prob", "update_actor")}
    times = {}
    for name, fn in phases.items():
        jax.block_until_ready(fn())  # compile
        ts = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append(time.perf_counter() - t0)
        times[name] = float(np.median(ts))
    profile = None
    if args.profile:  # one more of each phase under the profiler: where the device time goes
        from scripts.trace_summary import summarise_latest

        out = Path(args.profile) / args.one.replace("=", "").replace(",", "_")
        with jax.profiler.trace(str(out), create_perfetto_trace=True):
            for name, fn in phases.items():
                with jax.profiler.TraceAnnotation(name):
                    jax.block_until_ready(fn())
        profile = summarise_latest(out, top=12)
    tokens = args.batch * args.seq
    step = sum(times.values())
    peak = device_peak_flops()[0]  # the card's specified peak (a measured one where it is not known)
    flops = step_flops(flops_model(cfg), np.full(args.batch, args.seq), np.full(args.batch, resp))
    mem = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in mesh.devices.flat)
    return {"model": args.model, "mesh": args.one, "devices": n_dev, "batch": args.batch, "seq": args.seq,
            "micro_per_device": micro,
            "step_s": step, **{f"{k}_s": v for k, v in times.items()}, "tokens_per_s": tokens / step,
            "update_tokens_per_s": tokens / (times["update_actor"] + times.get("update_critic", 0.0)),
            "mfu_actor": flops / times["update_actor"] / (peak * n_dev), "peak_tflops": peak / 1e12,
            "peak_mem_gb_per_device": mem / 2**30, "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, **({"profile": profile} if profile else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--meshes", default="single;data=2;fsdp=2;tensor=2")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per mini-batch (the same on every mesh)")
    p.add_argument("--micro-per-device", type=int, default=0,
                   help="sequences per device per micro-batch instead (verl's *_micro_batch_size_per_gpu): more "
                        "devices, fewer micro-batches")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--remat", default="full")
    p.add_argument("--profile", default=None, help="dir: trace one more of each phase per mesh, summarise it")
    p.add_argument("--actor-only", action="store_true", help="leave out the critic's phases")
    p.add_argument("--json-out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one mesh, print JSON
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
    rows = []
    for mesh in args.meshes.split(";"):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", mesh, "--model", args.model, "--batch",
               str(args.batch), "--seq", str(args.seq), "--micro-batches", str(args.micro_batches),
               "--micro-per-device", str(args.micro_per_device), "--steps",
               str(args.steps), "--remat", args.remat] + (["--profile", args.profile] if args.profile else []) \
            + (["--actor-only"] if args.actor_only else [])
        res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        if res.returncode != 0 or not line:
            rows.append({"model": args.model, "mesh": mesh, "error": (res.stderr or res.stdout)[-500:]})
            print(f"{mesh}: failed\n{res.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(line[0][len("RESULT "):]))
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r.get("mesh") == "single" and "error" not in r), None)
    print(f"\n{'mesh':18} {'dev':>3} {'step s':>7} {'fwd lp':>7} {'values':>7} {'upd crit':>8} {'upd act':>8} "
          f"{'tok/s':>9} {'upd tok/s':>10} {'vs 1 dev':>8} {'MFU':>6} {'peak GB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['mesh']:18} failed")
            continue
        rel = r["update_tokens_per_s"] / base["update_tokens_per_s"] if base else float("nan")
        print(f"{r['mesh']:18} {r['devices']:3d} {r['step_s']:7.3f} {r['old_log_prob_s']:7.3f} {r.get('values_s', 0):7.3f} "
              f"{r.get('update_critic_s', 0):8.3f} {r['update_actor_s']:8.3f} {r['tokens_per_s']:9.0f} "
              f"{r['update_tokens_per_s']:10.0f} {rel:8.2f} {r['mfu_actor']:6.1%} {r['peak_mem_gb_per_device']:8.1f}")
    if args.profile:
        from scripts.trace_summary import print_summary

        for r in rows:
            if r.get("profile"):
                print(f"\n== {r['mesh']}: one of each phase")
                print_summary(r["profile"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
