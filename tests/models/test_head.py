"""The vocabulary head as the engine runs it (`models.transformer.head_logits`, `engine.response_head`): the weights
cast to the compute dtype once per program, the master weights' gradient summed in their own dtype, and chunks of
any size giving the same log-probs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxppo.engine import _chunks, response_head
from jaxppo.models import abstract_params, build_model, init_params
from jaxppo.models.transformer import head_logits, head_weight
from jaxppo.sharding import make_mesh, param_shardings
from scripts.shapes import SHAPES


def _model(tied: bool, dtype=jnp.bfloat16):
    cfg = dataclasses.replace(SHAPES["tiny"], tie_word_embeddings=tied)
    module = build_model(cfg, dtype=dtype, param_dtype=jnp.float32)
    mesh = make_mesh({"data": -1})
    params = init_params(module, jax.random.PRNGKey(0), param_shardings(abstract_params(module), mesh))
    return cfg, module, params


@pytest.mark.parametrize("tied", [True, False])
def test_head_logits_are_the_modules_logits(tied):
    cfg, module, params = _model(tied)
    h = jax.random.normal(jax.random.PRNGKey(1), (2, 5, cfg.hidden_size)).astype(jnp.bfloat16)
    w = head_weight(cfg, params)
    got = head_logits(h, w.astype(jnp.bfloat16), w)
    want = module.apply({"params": params}, h, method="logits")
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_master_weights_gradient_is_summed_unrounded():
    """d/dw of sum(c * logits) is sum over tokens of g h^T with g = c in bf16 (the cotangent through the cast to
    float32): the float32 GEMM output matches the float64 sum of the same bf16 factors to float32 precision, where a
    gradient rounded to bf16 (the module's own path: a bf16 GEMM output) is off by ~1e-3."""
    rng = np.random.default_rng(0)
    v, d = 300, 48
    h = jnp.asarray(rng.normal(size=(3, 40, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(v, d)) * 0.05, jnp.float32)
    c = jnp.asarray(rng.normal(size=(3, 40, v)), jnp.float32)
    w_c = jax.lax.stop_gradient(w.astype(jnp.bfloat16))

    def loss(w, h):
        return jnp.sum(head_logits(h, w_c, w).astype(jnp.float32) * c)

    dw, dh = jax.grad(loss, argnums=(0, 1))(w, h)
    g = np.asarray(c.astype(jnp.bfloat16), np.float64)
    want = np.einsum("btv,btd->vd", g, np.asarray(h, np.float64))
    assert dw.dtype == jnp.float32
    rel = np.abs(np.asarray(dw, np.float64) - want).max() / np.abs(want).max()
    assert rel < 1e-5, rel
    plain = jax.grad(lambda w: jnp.sum(jnp.einsum("btd,vd->btv", h, w.astype(jnp.bfloat16)).astype(jnp.float32) * c))(w)
    assert np.abs(np.asarray(plain, np.float64) - want).max() / np.abs(want).max() > 1e-4  # what the test tells apart
    # the gradient w.r.t. the hidden states is the plain path's, bit for bit
    want_dh = jax.grad(lambda h: jnp.sum(jnp.einsum("btd,vd->btv", h, w_c).astype(jnp.float32) * c))(h)
    np.testing.assert_array_equal(np.asarray(dh, np.float32), np.asarray(want_dh, np.float32))


def test_chunks_are_equal_and_pad_less_than_one_token_each():
    x = jnp.arange(2 * 100).reshape(2, 100)
    assert _chunks(x, 2048).shape == (1, 2, 100)  # a size above the row: one chunk of the row
    assert _chunks(x, 30).shape == (4, 2, 25)  # four chunks, none of them padding
    assert _chunks(x, 33).shape == (4, 2, 25)
    y = _chunks(x, 7)  # 15 chunks of 7: 5 padded slots at the end
    assert y.shape == (15, 2, 7)
    np.testing.assert_array_equal(np.moveaxis(np.asarray(y), 0, 1).reshape(2, -1)[:, :100], np.asarray(x))


@pytest.mark.parametrize("tied", [True, False])
def test_log_probs_and_gradients_do_not_depend_on_the_chunk_size(tied):
    cfg, module, params = _model(tied, jnp.float32)
    rng = np.random.default_rng(1)
    b, t, r = 3, 20, 12
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "positions": pos}
    adv = jnp.asarray(rng.normal(size=(b, r)), jnp.float32)

    def run(chunk):
        def loss(p):
            out = response_head(module, p, batch, r, chunk, remat=False)
            return jnp.sum(out["logprobs"] * adv) + 0.1 * jnp.sum(out["entropy"]), out["logprobs"]
        return jax.grad(loss, has_aux=True)(params)

    want_g, want_lp = run(r)
    for chunk in (5, 7, 4096):
        g, lp = run(chunk)
        np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), rtol=1e-6, atol=1e-6)
        jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6), g, want_g)  # summation order
