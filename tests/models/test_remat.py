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


def _residual_bytes(tiny_qwen, remat: str, unroll: int = 1) -> int:
    """Bytes the forward pass saves for the backward pass (jax's own account of a function's residuals)."""
    from jax._src.ad_checkpoint import saved_residuals

    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 100, (2, 12)), jnp.int32)
    seg, pos = jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(12), ids.shape)
    module, params, _ = load_model(tiny_qwen, remat=remat, scan_unroll=unroll)
    loss = lambda p: jnp.mean(module.apply({"params": p}, ids, pos, seg, method="forward_logits") ** 2)  # noqa: E731
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, _ in saved_residuals(loss, params))


def test_each_remat_policy_saves_what_it_says(tiny_qwen):
    """none keeps every activation, full only each layer's input, dots the matmul outputs as well; dots_attn is
    dots plus the fused attention's forward outputs, which exist only on GPU (cuDNN): on CPU it saves what dots
    saves. A policy that was ignored would save what none saves."""
    saved = {r: _residual_bytes(tiny_qwen, r) for r in ("none", "dots", "dots_attn", "full")}
    assert saved["none"] > saved["dots"] > saved["full"], saved
    assert saved["dots_attn"] == saved["dots"], saved


def test_dots_attn_policy_keeps_the_cudnn_attention_forward():
    from jaxppo.models.transformer import REMAT_POLICIES

    class Prim:
        def __init__(self, name):
            self.name = name

    policy, dots = REMAT_POLICIES["dots_attn"], REMAT_POLICIES["dots"]
    attention = Prim("dot_product_attention_fwd_wrapper")  # the custom call JAX's cuDNN attention binds
    assert policy(attention) and not dots(attention)
    assert not policy(Prim("exp")) and not REMAT_POLICIES["full"](attention)


@pytest.mark.parametrize("unroll", [0, 2])
def test_scan_unroll_changes_the_program_not_the_numbers(tiny_qwen, unroll):
    """model.scan_unroll: the same logits and gradients as the layer loop; unroll 0 leaves no loop at all."""
    rng = np.random.default_rng(2)
    ids = jnp.asarray(rng.integers(0, 100, (2, 12)), jnp.int32)
    seg, pos = jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(12), ids.shape)

    def run(u):
        module, params, _ = load_model(tiny_qwen, remat="full", scan_unroll=u)
        loss = lambda p: jnp.mean(module.apply({"params": p}, ids, pos, seg, method="forward_logits") ** 2)  # noqa: E731
        # the program JAX hands to XLA (StableHLO): a layer loop is a while op there. Not the compiled program: on
        # some CPUs LLVM's instruction selection spends tens of minutes on the unrolled gradient's single block
        hlo = jax.jit(jax.grad(loss)).lower(params).as_text()
        return jax.value_and_grad(loss)(params), hlo

    (l1, g1), loop_hlo = run(1)
    (lu, gu), hlo = run(unroll)
    np.testing.assert_allclose(lu, l1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), gu, g1)
    assert "while" in loop_hlo
    if unroll == 0:  # (unroll 2 of this model's 2 layers is a whole unroll too)
        assert "while" not in hlo


def test_remat_prevent_cse_keeps_the_numbers_and_the_recomputation_apart(tiny_qwen):
    """build_model(prevent_cse=True): with every layer unrolled, the same loss and gradients as without; the program
    then holds the optimisation barriers that keep XLA from merging the backward's recomputation with the forward
    (without them it may: no loop separates the two). A model option, no config key: on an H100 the 7B LoRA update
    held the same with it (docs/benchmarks.md, "The 7B LoRA update's memory on an H100")."""
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, 100, (2, 12)), jnp.int32)
    seg, pos = jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(12), ids.shape)

    def run(prevent_cse):
        module, params, _ = load_model(tiny_qwen, remat="full", scan_unroll=0, prevent_cse=prevent_cse)
        loss = lambda p: jnp.mean(module.apply({"params": p}, ids, pos, seg, method="forward_logits") ** 2)  # noqa: E731
        return jax.value_and_grad(loss)(params), jax.jit(jax.grad(loss)).lower(params).as_text()

    (l0, g0), merged = run(False)
    (l1, g1), apart = run(True)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g0)
    assert "optimization_barrier" in apart and "optimization_barrier" not in merged


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
