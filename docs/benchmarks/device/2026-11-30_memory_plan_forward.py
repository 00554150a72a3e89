"""Compile-only: memory plan of the actor forward / update for a model shape on a 2-device mesh."""
import os, sys, re, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
import flax.linen as nn
from jaxppo.config import ActorConfig, OptimConfig
from jaxppo.engine import ActorEngine
from jaxppo.models import build_model, abstract_params
from jaxppo.sharding import make_mesh, param_shardings
from scripts.shapes import SHAPES
from scripts.bench_update import synthetic_batch

name, shape, gather = sys.argv[1], eval(sys.argv[2]), sys.argv[3]
cfg = SHAPES[name]
mesh = make_mesh(shape, devices=jax.devices()[:2])
impl = "cudnn" if jax.default_backend() == "gpu" else None
mod = build_model(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, remat="dots_attn", attention_impl=impl)
ab = abstract_params(mod)
sh = param_shardings(ab, mesh)
params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(ab), sh)
eng = ActorEngine(mod, mesh, ActorConfig(ppo_micro_batch_size_per_device=4, log_prob_micro_batch_size_per_device=4,
                                         logprob_chunk_size=512, optim=OptimConfig(lr=1e-6)), 512, fsdp_gather=gather)
batch = eng.shard_batch(synthetic_batch(cfg, 16, 1024, 512))
eng._remember_specs(params)
with eng._ctx():
    t0 = time.time()
    c = jax.jit(lambda p, b: eng._forward_map(lambda pp, mb: eng._logprobs(pp, mb, False), p, b)).lower(params, batch).compile()
m = c.memory_analysis()
txt = c.as_text()
ags = re.findall(r"= (\w+\[[0-9,]*\])[^=]*? all-gather(?:-start)?\(", txt)
print(f"{name} {shape} {gather}: compile {time.time() - t0:.0f}s args {m.argument_size_in_bytes/2**30:.1f} GB "
      f"temp {m.temp_size_in_bytes/2**30:.1f} GB; all-gathers {len(ags)}: {sorted(set(ags))[:12]}", flush=True)
