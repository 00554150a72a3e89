"""JAX -> torch handover: zero-copy (same pointer) for each dtype; sharded arrays gathered per tensor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.dlpack import iter_torch_weights, jax_pointer, to_torch
from jaxppo.models.hf_io import export_hf_arrays
from jaxppo.models import load_model
from jaxppo.models.hf_io import iter_hf_names
from jaxppo.sharding import make_mesh


@pytest.mark.parametrize("dtype, tdtype", [(jnp.float32, torch.float32), (jnp.bfloat16, torch.bfloat16),
                                           (jnp.float16, torch.float16)])
def test_zero_copy_same_pointer(dtype, tdtype):
    x = jax.random.normal(jax.random.PRNGKey(0), (5, 7)).astype(dtype)
    t = to_torch(x)
    assert t.dtype == tdtype and t.data_ptr() == jax_pointer(x)
    np.testing.assert_array_equal(t.float().numpy(), np.asarray(x.astype(jnp.float32)))


def test_sharded_parameters_are_gathered_one_at_a_time(tiny_qwen):
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    _, params, cfg = load_model(tiny_qwen, mesh=mesh)
    _, ref, _ = load_model(tiny_qwen)
    ref_arrays = dict(export_hf_arrays(ref, jnp.bfloat16))
    names = []
    for name, t in iter_torch_weights(params, jnp.bfloat16):
        assert t.dtype == torch.bfloat16
        np.testing.assert_array_equal(t.float().numpy(), np.asarray(ref_arrays[name].astype(jnp.float32)))
        names.append(name)
    expected = [n for path in [("model", "embed_tokens", "weight")] for n in iter_hf_names(path, 2)]
    assert set(expected) <= set(names) and len(names) == len(ref_arrays)
    assert "model.layers.1.mlp.down_proj.weight" in names
