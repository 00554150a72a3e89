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


def test_logprob_head_kept_or_recomputed_same_gradients(tiny_qwen):
    """`actor.logprob_remat=false` keeps the chunks' logits for the backward pass instead of computing
    them again: the same log-probs, entropies and gradients."""
    from jaxppo.engine import response_logprobs

    rng = np.random.default_rng(1)
    r = 10
    ids = jnp.asarray(rng.integers(0, 100, (3, 16)), jnp.int32)
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids),
             "positions": jnp.broadcast_to(jnp.arange(16), ids.shape)}
    module, params, _ = load_model(tiny_qwen)
    w = jnp.asarray(rng.normal(size=(3, r)), jnp.float32)

    def run(remat):
        def loss(p):
            lp, ent = response_logprobs(module, p, batch, r, chunk_size=4, remat=remat)
            return jnp.sum(lp * w) + 0.1 * jnp.sum(ent), (lp, ent)
        return jax.grad(loss, has_aux=True)(params)

    def has_remat(remat):  # the option really changes the program: a checkpoint only when recomputing
        jaxpr = jax.make_jaxpr(lambda p: response_logprobs(module, p, batch, r, chunk_size=4, remat=remat))(params)
        return "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)

    assert has_remat(True) and not has_remat(False)
    (g0, (lp0, e0)), (g1, (lp1, e1)) = run(True), run(False)
    np.testing.assert_allclose(lp1, lp0, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(e1, e0, rtol=1e-6, atol=1e-6)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g0)) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g0)
