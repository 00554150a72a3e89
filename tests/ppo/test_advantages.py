"""Advantage estimators vs float64 numpy loops, on random masked batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxppo.ppo import ADVANTAGE_ESTIMATORS, compute_advantages, compute_gae
from tests.ppo import reference as ref
from tests.ppo.strategies import batches

SETTINGS = settings(max_examples=40, deadline=None)


@SETTINGS
@given(batches(), st.sampled_from([(0.99, 0.95), (1.0, 1.0), (0.5, 0.0), (1.0, 0.9)]))
def test_gae_matches_reference(data, gl):
    rng, mask = data
    gamma, lam = gl
    rewards, values = rng.normal(size=mask.shape), rng.normal(size=mask.shape)
    # garbage (even inf / NaN) at masked positions must not leak into valid ones
    adv, ret = jax.jit(compute_gae, static_argnums=(3, 4))(np.where(mask > 0, rewards, np.inf),
                                                          np.where(mask > 0, values, np.nan), mask, gamma, lam)
    exp_adv, exp_ret = ref.gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), exp_adv, atol=1e-9)
    np.testing.assert_allclose(np.asarray(ret), exp_ret, atol=1e-9)


def test_gae_masked_values_do_not_leak():
    rng = np.random.default_rng(0)
    mask = np.array([[1, 0, 1, 1, 0, 0]], np.float64)
    r, v = rng.normal(size=(1, 6)), rng.normal(size=(1, 6))
    a1, r1 = compute_gae(r, v, mask, 0.9, 0.8)
    v2, r2_in = v.copy(), r.copy()
    v2[mask == 0] = np.nan
    r2_in[mask == 0] = -np.inf
    a2, r2 = compute_gae(r2_in, v2, mask, 0.9, 0.8)
    np.testing.assert_allclose(np.asarray(a1), np.asarray(a2), atol=1e-9)
    np.testing.assert_allclose(np.asarray(r1), np.asarray(r2), atol=1e-9)


def _groups(rng, b):
    return rng.integers(0, max(1, b // 2), size=b).astype(np.int32)


@SETTINGS
@given(batches(), st.booleans())
def test_grpo_matches_reference(data, norm):
    rng, mask = data
    rewards = rng.normal(size=mask.shape)
    groups = _groups(rng, mask.shape[0])
    adv, ret = compute_advantages("grpo", rewards, mask, group_ids=groups, norm_adv_by_std_in_grpo=norm)
    np.testing.assert_allclose(np.asarray(adv), ref.grpo(rewards, mask, groups, norm), atol=1e-8)
    assert np.isfinite(np.asarray(adv)).all()


@SETTINGS
@given(batches())
def test_rloo_matches_reference(data):
    rng, mask = data
    rewards = rng.normal(size=mask.shape)
    groups = _groups(rng, mask.shape[0])
    adv, _ = jax.jit(lambda r, m, g: compute_advantages("rloo", r, m, group_ids=g))(rewards, mask, groups)
    np.testing.assert_allclose(np.asarray(adv), ref.rloo(rewards, mask, groups), atol=1e-9)


@SETTINGS
@given(batches(), st.sampled_from([1.0, 0.99, 0.5]))
def test_reinforce_plus_plus_matches_reference(data, gamma):
    rng, mask = data
    rewards = rng.normal(size=mask.shape)
    adv, ret = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=gamma)
    exp_adv, exp_ret = ref.reinforce_pp(rewards, mask, gamma)
    np.testing.assert_allclose(np.asarray(ret), exp_ret, atol=1e-9)
    np.testing.assert_allclose(np.asarray(adv), exp_adv, atol=1e-8)


def test_groups_of_one_are_defined():
    mask = np.ones((3, 4))
    rewards = np.zeros((3, 4))
    rewards[:, -1] = [1.0, -2.0, 0.5]
    groups = np.array([0, 1, 2], np.int32)
    for name in ("grpo", "rloo"):
        adv, _ = compute_advantages(name, rewards, mask, group_ids=groups)
        assert np.isfinite(np.asarray(adv)).all()
    adv, _ = compute_advantages("rloo", rewards, mask, group_ids=groups)
    np.testing.assert_allclose(np.asarray(adv)[:, 0], [1.0, -2.0, 0.5])


def test_estimators_vmap_over_a_leading_axis():
    rng = np.random.default_rng(1)
    r, v = rng.normal(size=(3, 4, 5)), rng.normal(size=(3, 4, 5))
    m = (rng.random((3, 4, 5)) < 0.8).astype(np.float64)
    adv, _ = jax.vmap(lambda a, b, c: compute_gae(a, b, c, 0.9, 0.9))(r, v, m)
    for k in range(3):
        np.testing.assert_allclose(np.asarray(adv[k]), ref.gae(r[k], v[k], m[k], 0.9, 0.9)[0], atol=1e-9)


def test_unknown_estimator_lists_known():
    with pytest.raises(KeyError, match=r"unknown advantage estimator 'ppo'.*gae.*grpo.*reinforce_plus_plus.*rloo"):
        compute_advantages("ppo", jnp.zeros((1, 1)), jnp.ones((1, 1)))
    assert set(ADVANTAGE_ESTIMATORS.names()) == {"gae", "grpo", "rloo", "reinforce_plus_plus", "grpo_passk",
                                                 "reinforce_plus_plus_baseline", "opo", "gpg", "remax"}
