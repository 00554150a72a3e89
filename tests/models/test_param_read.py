"""The model reads its parameters without flax's per-read trace of their initializers (jaxppo/models/transformer.py
`_param`); the shape check flax made there is made directly: a parameter of another shape than the config makes is
refused, naming it."""

import jax
import jax.numpy as jnp
import pytest
from flax import traverse_util

from jaxppo.models import build_model, init_params
from jaxppo.models.config import ModelConfig

CFG = ModelConfig("qwen2", 96, 32, 64, 2, 4, 2, 8, 1e-6, 1e4, False, True)


def test_a_parameter_of_another_shape_is_refused_by_name():
    module = build_model(CFG)
    params = init_params(module, jax.random.PRNGKey(0))
    ids = jnp.ones((1, 4), jnp.int32)
    module.apply({"params": params}, ids, jnp.ones_like(ids), jnp.arange(4)[None])  # as made: runs
    flat = traverse_util.flatten_dict(params)
    key = next(k for k in flat if k[-2:] == ("o_proj", "weight"))
    flat[key] = jnp.zeros(flat[key].shape[:-1] + (flat[key].shape[-1] + 1,), flat[key].dtype)
    with pytest.raises(ValueError, match=r"o_proj/weight has shape .*; the model's config makes it"):
        module.apply({"params": traverse_util.unflatten_dict(flat)}, ids, jnp.ones_like(ids), jnp.arange(4)[None])
