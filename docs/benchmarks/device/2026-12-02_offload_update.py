"""Optimizer offload on one GPU, Qwen2.5-7B's parameter shapes in fp32 (28 stacked decoder layers): what the
update program holds on the device when AdamW's moments live in pinned host memory, for two ways of writing it,
and the link's measured host <-> device rate. Usage: python docs/benchmarks/device/2026-12-02_offload_update.py
  all_at_once   every moment fetched, the whole tree updated, every moment stored (jaxppo's first offload)
  by_leaf       jaxppo's step (jaxppo/offload.py): one parameter at a time, the next parameter's fetch after the
                previous one's store (an optimization barrier)
Prints per variant: the compiled program's device temp / arguments / outputs (XLA memory analysis), the measured
device peak and the time of one update (median of 3 after a warm-up), then the link's rate."""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

H, I, V, L, KV = 3584, 18944, 152064, 28, 512
SHAPES = {"embed": (V, H), "lm_head": (V, H), "q": (L, H, H), "k": (L, H, KV), "v": (L, H, KV), "o": (L, H, H),
          "gate": (L, H, I), "up": (L, H, I), "down": (L, I, H), "norms": (L, 2, H)}
if "--small" in sys.argv:
    SHAPES = {k: tuple(max(1, s // 16) for s in v) for k, v in SHAPES.items()}
dev_kind = jax.devices()[0].default_memory().kind
d = jax.devices()[0]
DEV = jax.sharding.SingleDeviceSharding(d, memory_kind=dev_kind)
HOST = jax.sharding.SingleDeviceSharding(d, memory_kind="pinned_host")
tx = optax.adamw(1e-6, weight_decay=0.01)
params_abs = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=DEV) for k, s in SHAPES.items()}
treedef = jax.tree.structure(params_abs)
opt_abs = jax.eval_shape(tx.init, params_abs)
opt_sh = jax.tree.map(lambda x: HOST if x.ndim > 0 else DEV, opt_abs)
opt_abs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt_abs, opt_sh)
shaped = lambda x: jax.tree.structure(x) == treedef  # noqa: E731
to_dev = lambda x: jax.device_put(x, DEV)  # noqa: E731
to_host = lambda x: jax.device_put(x, HOST)  # noqa: E731


def all_at_once(p, g, o):
    o = jax.tree.map(lambda x, s: to_dev(x) if s is HOST else x, o, opt_sh)
    u, o = tx.update(g, o, p)
    o = jax.tree.map(lambda x, s: to_host(x) if s is HOST else x, o, opt_sh)
    return optax.apply_updates(p, u), o


def by_leaf(p, g, o):
    """jaxppo's offloaded step (jaxppo/offload.py), clipping included."""
    from jaxppo.offload import step

    parts = (optax.clip_by_global_norm(1.0), tx)
    new_p, (_, o) = step(parts, g, ((optax.EmptyState()), o), p, (None, opt_sh))
    return new_p, o


def rate(nbytes=4 << 30):
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), DEV).block_until_ready()
    out = {}
    for name, fn in (("d2h", lambda: jax.device_put(x, HOST)), ("h2d", None)):
        ts = []
        src = x if name == "d2h" else jax.device_put(x, HOST).block_until_ready()
        for _ in range(4):
            t = time.perf_counter()
            (jax.device_put(src, HOST) if name == "d2h" else jax.device_put(src, DEV)).block_until_ready()
            ts.append(time.perf_counter() - t)
        out[name + "_GBps"] = round(nbytes / statistics.median(ts[1:]) / 1e9, 1)
    return out


def main():
    n = sum(int(jnp.prod(jnp.array(s))) for s in SHAPES.values())
    res = {"params": n, "params_fp32_GB": round(4 * n / 1e9, 2), "moments_GB": round(8 * n / 1e9, 2),
           "device": str(d), "jax": jax.__version__}
    res.update(rate())
    print(json.dumps(res), flush=True)
    for fn in (all_at_once, by_leaf):
        row = {"variant": fn.__name__}
        try:
            out_sh = (jax.tree.map(lambda _: DEV, params_abs), opt_sh)
            t = time.perf_counter()
            c = jax.jit(fn, donate_argnums=(0, 2), out_shardings=out_sh).lower(params_abs, params_abs, opt_abs).compile()
            row["compile_s"] = round(time.perf_counter() - t, 1)
            m = c.memory_analysis()
            for k in ("temp", "argument", "output", "alias", "host_temp", "host_argument", "host_output"):
                row[k + "_GB"] = round(getattr(m, k + "_size_in_bytes") / 1e9, 2)
            limit = (d.memory_stats() or {}).get("bytes_limit", float("inf")) / 1e9
            if row["temp_GB"] + row["argument_GB"] > 0.9 * limit:
                row["ran"] = "skipped: does not fit"
                print(json.dumps(row), flush=True)
                continue
            p = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype, device=DEV), params_abs)
            g = jax.tree.map(lambda s: jnp.full(s.shape, 1e-3, s.dtype, device=DEV), params_abs)
            o = jax.jit(tx.init, out_shardings=opt_sh)(p)
            ts = []
            for _ in range(4):
                t = time.perf_counter()
                p, o = c(p, g, o)
                jax.block_until_ready((p, o))
                ts.append(time.perf_counter() - t)
            row["update_s"] = round(statistics.median(ts[1:]), 3)
            row["moved_GBps"] = round(2 * res["moments_GB"] / row["update_s"], 1)
            row["peak_GB"] = round((d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9, 2)
            row["mu_kind"] = jax.tree.leaves(o)[1].sharding.memory_kind
            del p, g, o
        except Exception as e:  # noqa: BLE001 - a variant XLA refuses is a result
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
