"""Every remat policy computes the same gradients as keeping all activations (fp32; recomputation
reorders some sums, hence ~1e-7 differences)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxppo.models import load_model


@pytest.mark.parametrize("remat", ["full", "dots_attn"])  # dots_attn: jaxppo's own policy (a superset of dots)
def test_remat_policy_keeps_gradients(tiny_qwen, remat):
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 100, (2, 12)), jnp.int32)
    seg = jnp.ones_like(ids)
    pos = jnp.broadcast_to(jnp.arange(12), ids.shape)

    def grads(policy):
        module, params, _ = load_model(tiny_qwen, remat=policy)
        loss = lambda p: jnp.mean(module.apply({"params": p}, ids, pos, seg, method="forward_logits") ** 2)
        return jax.grad(loss)(params)

    want, got = grads("none"), grads(remat)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(want)) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got, want)
