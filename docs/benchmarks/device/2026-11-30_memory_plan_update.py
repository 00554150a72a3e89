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

name, shape, gather, micro = sys.argv[1], eval(sys.argv[2]), sys.argv[3], int(sys.argv[4])
cfg = SHAPES[name]
mesh = make_mesh(shape, devices=jax.devices()[:2])
impl = "cudnn" if jax.default_backend() == "gpu" else None
mod = build_model(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=sys.argv[5] if len(sys.argv) > 5 else "dots_attn", attention_impl=impl)
ab = abstract_params(mod)
sh = param_shardings(ab, mesh)
params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(ab), sh)
eng = ActorEngine(mod, mesh, ActorConfig(ppo_micro_batch_size_per_device=micro, log_prob_micro_batch_size_per_device=micro,
                                         logprob_chunk_size=512, optim=OptimConfig(lr=1e-6)), 512, fsdp_gather=gather)
batch = eng.shard_batch(synthetic_batch(cfg, 16, 1024, 512))
from jaxppo.engine import TrainState
from jax.sharding import NamedSharding, PartitionSpec as P
init = jax.jit(eng.tx.init)
osh = init.lower(params).compile().output_shardings
oab = jax.eval_shape(eng.tx.init, params)
import optax
whole = NamedSharding(mesh, P())
osh = optax.tree_map_params(eng.tx, lambda _, p: p.sharding, oab, params, transform_non_params=lambda _: whole)
opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), oab, osh)
st = TrainState(params, opt, jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())))
eng._remember_specs(params)
with eng._ctx():
    f = jax.jit(lambda s, b: eng._accumulate(eng._loss, s, b), donate_argnums=0)
    t0 = time.time()
    c = f.lower(st, batch).compile()
m = c.memory_analysis()
print(f"{name} {shape} {gather} micro {micro}: compile {time.time()-t0:.0f}s args {m.argument_size_in_bytes/2**30:.1f} GB out {m.output_size_in_bytes/2**30:.1f} temp {m.temp_size_in_bytes/2**30:.1f} GB alias {m.alias_size_in_bytes/2**30:.1f}", flush=True)
