"""GPU: a row that is not one contiguous sequence comes out NaN through the cuDNN path; the other rows
equal the same rows computed alone."""
import os, sys
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
from jaxppo.models import build_model, init_params
from scripts.shapes import SHAPES

mod = build_model(SHAPES["qwen2.5-0.5b"], dtype=jnp.bfloat16, param_dtype=jnp.float32, attention_impl="cudnn")
params = init_params(mod, jax.random.PRNGKey(0))
rng = np.random.default_rng(0)
ids = jnp.asarray(rng.integers(1, 1000, (3, 64)), jnp.int32)
seg = np.ones((3, 64), np.int32)
seg[0, :10] = 0          # left padding: fine
seg[1, 30] = 0           # a hole: poisoned
seg[2, 50:] = 0          # right padding: fine
pos = jnp.asarray(np.maximum(np.cumsum(seg, 1) - 1, 0), jnp.int32)
out = np.asarray(mod.apply({"params": params}, ids, pos, jnp.asarray(seg)).astype(jnp.float32))
alone = np.asarray(mod.apply({"params": params}, ids[::2], pos[::2], jnp.asarray(seg[::2])).astype(jnp.float32))
print("poisoned row all NaN:", bool(np.isnan(out[1]).all()), " others finite:", bool(np.isfinite(out[[0, 2]]).all()),
      " others equal alone:", bool(np.array_equal(out[[0, 2]], alone)))
