"""Advantage estimators under verl's names: GAE, GRPO (and Dr.GRPO), GRPO pass@k, RLOO, REINFORCE++ (and its
group baseline), OPO, GPG; chosen by name from a registry. Each equals verl 0.9.1's `core_algos` function of the
same name in float64 (tests/verl_oracle).

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
    """Discounted return-to-go per token, whitened over valid tokens. A masked token (an observation span inside
    the response) carries the running return through unchanged, so rewards after it reach the tokens before it
    (verl 0.9.1; earlier verl reset the return there)."""
    mask = response_mask.astype(token_level_rewards.dtype)

    def step(running, x):
        r, m = x
        new = r + gamma * running
        return jnp.where(m > 0, new, running), jnp.where(m > 0, new, 0.0)

    returns = _reverse_scan(step, jnp.zeros(mask.shape[0], mask.dtype), (token_level_rewards.astype(mask.dtype), mask))
    return masked_whiten(returns, mask), returns


@ADVANTAGE_ESTIMATORS.register("remax")
def remax_estimator(token_level_rewards, response_mask, *, reward_baselines, **_):
    """ReMax (arXiv:2310.10505): the return-to-go minus the reward of the prompt's greedy response
    (`reward_baselines`, per sequence: the trainer generates and scores one greedy response per prompt)."""
    mask = response_mask.astype(token_level_rewards.dtype)
    returns = jnp.flip(jnp.cumsum(jnp.flip(token_level_rewards * mask, -1), -1), -1)
    return returns - reward_baselines[:, None] * mask, returns


def _outcome(token_level_rewards, response_mask):
    mask = response_mask.astype(token_level_rewards.dtype)
    return mask, masked_sum(token_level_rewards, mask, axis=-1)


def _per_token(adv, mask):
    adv = jnp.where(mask > 0, adv[:, None], 0.0)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("grpo_passk")
def grpo_passk_estimator(token_level_rewards, response_mask, *, group_ids, norm_adv_by_std_in_grpo: bool = True,
                         epsilon: float = 1e-6, **_):
    """Pass@k (arXiv:2503.19595): only each group's best response gets an advantage, its score minus the group's
    second best (over the group's std + eps when `norm_adv_by_std_in_grpo`); ties go to the first. Needs groups of
    at least two (rollout.n >= 2, checked at start)."""
    mask, scores = _outcome(token_level_rewards, response_mask)
    n = scores.shape[0]
    idx = jnp.arange(n)
    gmax = jax.ops.segment_max(scores, group_ids, num_segments=n)[group_ids]
    first = jax.ops.segment_min(jnp.where(scores == gmax, idx, n), group_ids, num_segments=n)[group_ids]
    best = idx == first
    second = jax.ops.segment_max(jnp.where(best, -jnp.inf, scores), group_ids, num_segments=n)[group_ids]
    adv = jnp.where(best, gmax - second, 0.0)
    if norm_adv_by_std_in_grpo:
        adv = adv / (group_stats(scores, group_ids)[2] + epsilon)
    return _per_token(adv, mask)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_estimator(token_level_rewards, response_mask, *, group_ids, **_):
    """REINFORCE++ with the group's mean as baseline (arXiv:2501.03262): score - group mean (0 for a group of one),
    broadcast over the response and whitened over the batch's valid tokens."""
    mask, scores = _outcome(token_level_rewards, response_mask)
    count, mean, _ = group_stats(scores, group_ids)
    adv = jnp.where(mask > 0, (scores - jnp.where(count > 1, mean, 0.0))[:, None], 0.0)
    adv = masked_whiten(adv, mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("opo")
def opo_estimator(token_level_rewards, response_mask, *, group_ids, **_):
    """OPO (arXiv:2505.23585): score minus the group's length-weighted mean score (0 for a group of one)."""
    mask, scores = _outcome(token_level_rewards, response_mask)
    n = scores.shape[0]
    length = jnp.sum(mask, axis=-1)
    count = jax.ops.segment_sum(jnp.ones_like(scores), group_ids, num_segments=n)[group_ids]
    num = jax.ops.segment_sum(length * scores, group_ids, num_segments=n)[group_ids]
    den = jax.ops.segment_sum(length, group_ids, num_segments=n)[group_ids]
    base = jnp.where(count > 1, num / jnp.where(den > 0, den, 1.0), 0.0)
    return _per_token(scores - base, mask)


@ADVANTAGE_ESTIMATORS.register("gpg")
def gpg_estimator(token_level_rewards, response_mask, *, group_ids, f_norm: float = 1.0, **_):
    """GPG (arXiv:2504.02546): alpha (score - group mean) / f_norm, alpha = batch size / the number of non-zero
    scores (at least 1); a group of one has mean 0."""
    mask, scores = _outcome(token_level_rewards, response_mask)
    count, mean, _ = group_stats(scores, group_ids)
    alpha = scores.shape[0] / jnp.maximum(jnp.sum(scores != 0), 1)
    return _per_token(alpha * (scores - jnp.where(count > 1, mean, 0.0)) / f_norm, mask)


def compares_groups(name: str) -> bool:
    """Whether the estimator registered as `name` compares each prompt's responses (it takes `group_ids`): a run
    needs rollout.n >= 2 for it."""
    import inspect

    return "group_ids" in inspect.signature(ADVANTAGE_ESTIMATORS.get(name)).parameters


def compute_advantages(name: str, token_level_rewards, response_mask, **kw) -> tuple[Array, Array]:
    """Dispatch to the estimator registered as `name`."""
    return ADVANTAGE_ESTIMATORS.get(name)(token_level_rewards, response_mask, **kw)
