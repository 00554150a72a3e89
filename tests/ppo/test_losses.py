"""Policy / value losses, aggregation, KL, entropy, importance correction vs float64 numpy references."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxppo import ppo
from tests.ppo import reference as ref
from tests.ppo.strategies import batches

SETTINGS = settings(max_examples=30, deadline=None)
MODES = list(ppo.LOSS_AGG_MODES)


@SETTINGS
@given(batches(), st.sampled_from(MODES))
def test_agg_loss_matches_reference(data, mode):
    rng, mask = data
    loss = rng.normal(size=mask.shape)
    got = jax.jit(ppo.agg_loss, static_argnums=2)(np.where(mask > 0, loss, np.nan), mask, mode)
    np.testing.assert_allclose(float(got), ref.agg(loss, mask, mode), atol=1e-10)


@SETTINGS
@given(batches(max_b=8), st.sampled_from(MODES), st.sampled_from([1, 2, 4]))
def test_agg_loss_micro_batches_sum_to_full_batch(data, mode, n_micro):
    """The property gradient accumulation relies on: each micro-batch normalised by the mini-batch's
    token and sequence counts; summing the micro-batch losses gives the full-batch loss."""
    rng, mask = data
    b = mask.shape[0]
    if b % n_micro:
        mask = np.concatenate([mask, np.zeros((n_micro - b % n_micro, mask.shape[1]))])
    loss = rng.normal(size=mask.shape)
    full = ppo.agg_loss(loss, mask, mode)
    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    parts = [ppo.agg_loss(l, m, mode, num_tokens=num_tokens, num_seqs=num_seqs)
             for l, m in zip(np.split(loss, n_micro), np.split(mask, n_micro))]
    np.testing.assert_allclose(float(sum(parts)), float(full), atol=1e-10)


@SETTINGS
@given(batches(), st.sampled_from(MODES), st.sampled_from([(0.2, 0.2, 3.0), (0.1, 0.28, 2.0), (0.2, 0.2, 10.0)]),
       st.sampled_from([1.0, 30.0]))
def test_policy_loss_matches_reference(data, mode, clip, scale):
    rng, mask = data
    low, high, c = clip
    old = rng.normal(size=mask.shape) * scale  # scale 30: extreme log-ratios, clamped at +-20
    new = old + rng.normal(size=mask.shape) * 0.3 * scale
    adv = rng.normal(size=mask.shape)
    loss, m = jax.jit(ppo.policy_loss, static_argnums=(4, 5, 6, 7))(old, new, adv, mask, low, high, c, mode)
    e_loss, e_clip, e_lower, e_kl = ref.policy_loss(old, new, adv, mask, low, high, c, mode)
    np.testing.assert_allclose(float(loss), e_loss, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(float(m["pg_clipfrac"]), e_clip, atol=1e-12)
    np.testing.assert_allclose(float(m["pg_clipfrac_lower"]), e_lower, atol=1e-12)
    np.testing.assert_allclose(float(m["ppo_kl"]), e_kl, atol=1e-9)
    assert np.isfinite(float(loss))


@SETTINGS
@given(batches(), st.sampled_from(MODES), st.sampled_from([0.2, 0.5, 10.0]))
def test_value_loss_matches_reference(data, mode, c):
    rng, mask = data
    v, old_v, ret = (rng.normal(size=mask.shape) for _ in range(3))
    loss, m = ppo.value_loss(v, old_v, ret, mask, c, mode)
    e_loss, e_clip = ref.value_loss(v, old_v, ret, mask, c, mode)
    np.testing.assert_allclose(float(loss), e_loss, atol=1e-10)
    np.testing.assert_allclose(float(m["vf_clipfrac"]), e_clip, atol=1e-12)


def _central_diff(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        g[idx] = (f(xp) - f(xm)) / (2 * eps)
    return g


@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_gradient_matches_finite_differences(mode):
    rng = np.random.default_rng(0)
    mask = (rng.random((3, 5)) < 0.8).astype(np.float64)
    old = rng.normal(size=(3, 5))
    new = old + rng.normal(size=(3, 5)) * 0.1  # small steps: away from the clip kinks
    adv = rng.normal(size=(3, 5))
    f = lambda lp: ppo.policy_loss(old, lp, adv, mask, 0.2, 0.2, 3.0, mode)[0]
    g = np.asarray(jax.grad(f)(new))
    assert np.isfinite(g).all()
    np.testing.assert_allclose(g, _central_diff(lambda x: float(f(x)), new), atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_value_loss_gradient_matches_finite_differences(mode):
    rng = np.random.default_rng(1)
    mask = (rng.random((3, 5)) < 0.8).astype(np.float64)
    old_v, ret = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
    v = old_v + rng.normal(size=(3, 5)) * 0.3
    f = lambda x: ppo.value_loss(x, old_v, ret, mask, 0.2, mode)[0]
    g = np.asarray(jax.grad(f)(v))
    assert np.isfinite(g).all()
    np.testing.assert_allclose(g, _central_diff(lambda x: float(f(x)), v), atol=1e-6)


def test_policy_loss_gradient_finite_at_extreme_ratios():
    old = np.zeros((2, 3))
    new = np.array([[50.0, -50.0, 0.0], [25.0, -25.0, 1.0]])
    adv = np.array([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]])
    g = jax.grad(lambda lp: ppo.policy_loss(old, lp, adv, np.ones((2, 3)))[0])(new)
    assert np.isfinite(np.asarray(g)).all()


@SETTINGS
@given(batches(), st.sampled_from(["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]), st.sampled_from([0.5, 40.0]))
def test_kl_estimators_match_reference(data, kind, scale):
    rng, mask = data
    lp, rlp = rng.normal(size=mask.shape) * scale, rng.normal(size=mask.shape) * scale
    got = np.asarray(jax.jit(ppo.kl_penalty, static_argnums=2)(lp, rlp, kind))
    np.testing.assert_allclose(got, ref.kl(lp, rlp, kind), rtol=1e-12, atol=1e-12)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("chunk", [1, 3, 7, 1024])
def test_full_kl_chunked_matches_reference(chunk):
    rng = np.random.default_rng(2)
    logits, ref_logits = rng.normal(size=(3, 5, 11)) * 3, rng.normal(size=(3, 5, 11)) * 3
    got = np.asarray(ppo.full_kl(logits, ref_logits, chunk_size=chunk))
    np.testing.assert_allclose(got, ref.full_kl(logits, ref_logits), atol=1e-6)  # computed in float32
    assert (got >= -1e-6).all()
    np.testing.assert_allclose(np.asarray(ppo.kl_penalty(logits, logits, "full")), 0.0, atol=1e-6)


@pytest.mark.parametrize("chunk", [None, 2, 5])
def test_entropy_matches_reference(chunk):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 5, 13)) * 10
    logits[0, 0, 0] = 1e4  # a near-deterministic token: stable, no NaN
    got = np.asarray(ppo.entropy_from_logits(logits, chunk_size=chunk))
    np.testing.assert_allclose(got, ref.entropy(logits), atol=1e-5)
    assert np.isfinite(got).all() and (got > -1e-6).all()


def test_kl_controllers():
    fixed = ppo.KLControlConfig(type="fixed", kl_coef=0.05)
    assert ppo.update_kl_coef(fixed, 0.05, 10.0, 256) == 0.05
    ada = ppo.KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.1, horizon=1000)
    # Ziegler et al.: beta <- beta (1 + clip(kl / target - 1, -0.2, 0.2) n / horizon), worked by hand:
    #   kl 0.5:  error clips at +0.2 -> 0.1 x (1 + 0.2 x 0.1)    = 0.102
    #   kl 0.01: error -0.9 clips at -0.2 -> 0.1 x (1 - 0.02)    = 0.098
    #   kl 0.11: error +0.1, n 64 -> 0.1 x (1 + 0.1 x 0.064)     = 0.10064
    #   kl 0:    error -1 clips at -0.2, n 1000 -> 0.1 x 0.8      = 0.08
    for kl, n, want in [(0.5, 100, 0.102), (0.01, 100, 0.098), (0.11, 64, 0.10064), (0.0, 1000, 0.08)]:
        np.testing.assert_allclose(float(ppo.update_kl_coef(ada, 0.1, kl, n)), want, rtol=1e-6)
    with pytest.raises(ValueError, match="unknown kl_ctrl type"):
        ppo.update_kl_coef(ppo.KLControlConfig(type="pid"), 0.1, 0.1, 1)


@SETTINGS
@given(batches(), st.sampled_from(["k1", "low_var_kl"]))
def test_kl_in_reward(data, kind):
    rng, mask = data
    scores = rng.normal(size=mask.shape[0])
    lp, rlp = rng.normal(size=mask.shape), rng.normal(size=mask.shape)
    token_scores = np.asarray(ppo.scores_to_token_level(scores, mask))
    for i in range(mask.shape[0]):
        valid = np.nonzero(mask[i])[0]
        expect = np.zeros(mask.shape[1])
        if len(valid):
            expect[valid[-1]] = scores[i]
        np.testing.assert_array_equal(token_scores[i], expect)
    rewards, current_kl = ppo.apply_kl_penalty(token_scores, lp, rlp, mask, 0.2, kind)
    kld = ref.kl(lp, rlp, kind) * mask
    np.testing.assert_allclose(np.asarray(rewards), token_scores - 0.2 * kld, atol=1e-12)
    per_seq = [ref.masked_mean(kld[i], mask[i]) for i in range(mask.shape[0])]
    np.testing.assert_allclose(float(current_kl), np.mean(per_seq), atol=1e-12)


def test_truncated_is_weights_and_mismatch_metrics():
    rng = np.random.default_rng(4)
    mask = (rng.random((4, 6)) < 0.7).astype(np.float64)
    trainer, rollout = rng.normal(size=(4, 6)) - 1, rng.normal(size=(4, 6)) - 1
    w = np.asarray(ppo.truncated_is_weights(trainer, rollout, mask, threshold=2.0))
    np.testing.assert_allclose(w, np.where(mask > 0, np.minimum(np.exp(trainer - rollout), 2.0), 0.0), rtol=1e-12)
    m = ppo.rollout_mismatch_metrics(trainer, rollout, mask)
    v = mask > 0
    pt, pr = np.exp(trainer[v]), np.exp(rollout[v])
    np.testing.assert_allclose(float(m["rollout/probs_diff_mean"]), np.abs(pt - pr).mean(), rtol=1e-12)
    np.testing.assert_allclose(float(m["rollout/probs_diff_max"]), np.abs(pt - pr).max(), rtol=1e-12)
    np.testing.assert_allclose(float(m["rollout/probs_pearson"]), np.corrcoef(pt, pr)[0, 1], rtol=1e-9)
    # the IS weights scale the per-token loss and carry no gradient
    adv = rng.normal(size=(4, 6))
    base = ppo.policy_loss(trainer, trainer, adv, mask)[0]
    weighted = ppo.policy_loss(trainer, trainer, adv, mask, is_weights=w)[0]
    np.testing.assert_allclose(float(weighted), ref.agg(-adv * w, mask, "token-mean"), atol=1e-12)
    assert float(base) != float(weighted)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalised_weights_are_the_whole_batchs_over_processes(level):
    """`rollout_is_batch_normalize` with the batch split over two processes (`total` sums a vector over them):
    each process's weights equal the rows of the single-process computation (the mean is the whole batch's)."""
    from jaxppo.ppo.rollout_correction import is_weights

    rng = np.random.default_rng(3)
    mask = (rng.random((10, 7)) < 0.8).astype(float)
    mask[2] = 0.0
    lr = rng.normal(0.0, 0.4, mask.shape)
    whole, _ = is_weights(lr, mask, level, "2.0", True)
    halves = (slice(0, 4), slice(4, 10))  # unequal shares, as the token counts are
    local = []
    for h in halves:  # each process's own vector, as `total` receives it
        is_weights(lr[h], mask[h], level, "2.0", True, total=lambda v: local.append(v) or v)
    for i, h in enumerate(halves):
        other = local[1 - i]
        w, _ = is_weights(lr[h], mask[h], level, "2.0", True, total=lambda v: v + other)
        np.testing.assert_allclose(w, whole[h], rtol=1e-12, atol=0)
    alone, _ = is_weights(lr[halves[0]], mask[halves[0]], level, "2.0", True)
    assert not np.allclose(alone, whole[halves[0]])  # a process's own mean would differ
