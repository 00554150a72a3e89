"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++; chosen by name from a registry.

Every estimator has the signature
    fn(token_level_rewards, response_mask, *, values, group_ids, gamma, lam, **options) -> (advantages, returns)
with [batch, response_len] arrays (group_ids: [batch] ints, the prompt each sample answers), and ignores
the arguments it does not use, so the trainer calls them all the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxppo.ppo.agg import masked_sum, masked_whiten
from jaxppo.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


def _reverse_scan(step, init, xs):
    """lax.scan over the time axis (axis 1 of [b, t] arrays), last step first."""
    xs_t = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), xs)
    _, ys = jax.lax.scan(step, init, xs_t, reverse=True)
    return jnp.swapaxes(ys, 0, 1)


def compute_gae(rewards: Float[Array, "b t"], values: Float[Array, "b t"], response_mask: Float[Array, "b t"],
                gamma: float, lam: float, whiten: bool = True) -> tuple[Array, Array]:
    """Token-level GAE. Masked positions are skipped: they pass the running value and advantage through
    unchanged, so they never leak into their neighbours. returns = advantages + values (before whitening);
    advantages are whitened over valid tokens when `whiten`. Both are 0 at masked positions."""
    mask = response_mask.astype(values.dtype)

    def step(carry, x):
        next_value, last_gae = carry
        r, v, m = x
        delta = r + gamma * next_value - v
        gae = delta + gamma * lam * last_gae
        valid = m > 0  # `where`, not arithmetic: NaN/inf at masked positions must not leak either
        next_value = jnp.where(valid, v, next_value)
        last_gae = jnp.where(valid, gae, last_gae)
        return (next_value, last_gae), last_gae

    zeros = jnp.zeros(values.shape[0], values.dtype)
    adv = _reverse_scan(step, (zeros, zeros), (rewards.astype(values.dtype), values, mask))
    returns = jnp.where(mask > 0, adv + values, 0.0)
    adv = masked_whiten(adv, mask) if whiten else jnp.where(mask > 0, adv, 0.0)
    return adv, returns


def group_stats(scores: Float[Array, "b"], group_ids: Int[Array, "b"]) -> tuple[Array, Array, Array]:
    """Per-sample (group size, group mean, unbiased group std) of `scores` by `group_ids` (jit-safe)."""
    n = scores.shape[0]
    ones = jnp.ones_like(scores)
    count = jax.ops.segment_sum(ones, group_ids, num_segments=n)[group_ids]
    mean = jax.ops.segment_sum(scores, group_ids, num_segments=n)[group_ids] / count
    sq = jax.ops.segment_sum((scores - mean) ** 2, group_ids, num_segments=n)[group_ids]
    std = jnp.sqrt(sq / jnp.maximum(count - 1, 1))
    return count, mean, std


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_estimator(token_level_rewards, response_mask, *, values, gamma=1.0, lam=1.0, **_):
    return compute_gae(token_level_rewards, values, response_mask, gamma, lam)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_estimator(token_level_rewards, response_mask, *, group_ids, norm_adv_by_std_in_grpo: bool = True,
                   epsilon: float = 1e-6, **_):
    """Outcome advantage (score - group mean) / (group std + eps), broadcast over the response.
    `norm_adv_by_std_in_grpo=False` is Dr.GRPO (no std). A group of one has mean 0 and std 1 (verl's rule)."""
    mask = response_mask.astype(token_level_rewards.dtype)
    scores = masked_sum(token_level_rewards, mask, axis=-1)
    count, mean, std = group_stats(scores, group_ids)
    mean = jnp.where(count > 1, mean, 0.0)
    std = jnp.where(count > 1, std, 1.0)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = jnp.where(mask > 0, adv[:, None], 0.0)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_estimator(token_level_rewards, response_mask, *, group_ids, **_):
    """Leave-one-out baseline: score minus the mean of the other samples of the prompt.
    A group of one has baseline 0 (verl's rule)."""
    mask = response_mask.astype(token_level_rewards.dtype)
    scores = masked_sum(token_level_rewards, mask, axis=-1)
    count, mean, _ = group_stats(scores, group_ids)
    loo = (scores * count - mean * count) / jnp.maximum(count - 1, 1)  # = score - mean(others)
    adv = jnp.where(mask > 0, jnp.where(count > 1, loo, scores)[:, None], 0.0)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus_estimator(token_level_rewards, response_mask, *, gamma=1.0, **_):
    """Discounted return-to-go per token (reset after masked tokens, as verl does), whitened over valid tokens."""
    mask = response_mask.astype(token_level_rewards.dtype)

    def step(running, x):
        r, m = x
        running = jnp.where(m > 0, r, 0.0) + gamma * running
        return jnp.where(m > 0, running, 0.0), running

    returns = _reverse_scan(step, jnp.zeros(mask.shape[0], mask.dtype), (token_level_rewards.astype(mask.dtype), mask))
    returns = jnp.where(mask > 0, returns, 0.0)
    return masked_whiten(returns, mask), returns


def compute_advantages(name: str, token_level_rewards, response_mask, **kw) -> tuple[Array, Array]:
    """Dispatch to the estimator registered as `name`."""
    return ADVANTAGE_ESTIMATORS.get(name)(token_level_rewards, response_mask, **kw)
