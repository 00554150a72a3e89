"""PPO policy and value losses, entropy, and rollout-vs-trainer importance correction.

Metrics that are token means (clip fractions, ppo_kl) are normalised by the same `num_tokens` as a
token-mean loss, so micro-batch values add up to the mini-batch value like the losses do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxppo.ppo.agg import agg_loss, masked_mean, masked_sum


def _token_mean(x, mask, num_tokens):
    if num_tokens is None:
        return masked_mean(x, mask)
    return masked_sum(x, mask) / jnp.maximum(num_tokens, 1)


def policy_loss(old_logprob: Float[Array, "b t"], logprob: Float[Array, "b t"], advantages: Float[Array, "b t"],
                response_mask: Float[Array, "b t"], clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean", *, is_weights: Array | None = None,
                num_tokens=None, num_seqs=None, horizon=None, token_weight=None) -> tuple[Array, dict[str, Array]]:
    """Clipped PPO surrogate with dual clip (Ye et al. 2020) for negative advantages.

    ratio = exp(clamp(logprob - old_logprob, -20, 20)); loss = max(-A r, -A clip(r, 1-low, 1+high)),
    and for A < 0 additionally min(that, -A * clip_ratio_c). `is_weights` (truncated importance weights
    for the rollout/trainer mismatch) multiply the per-token loss. Returns (loss, metrics) with
    pg_clipfrac, pg_clipfrac_lower, ppo_kl.
    """
    mask = response_mask
    log_ratio = jnp.clip(logprob - old_logprob, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    losses1 = -advantages * ratio
    losses2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped1 = jnp.maximum(losses1, losses2)
    losses3 = -advantages * clip_ratio_c
    clipped2 = jnp.minimum(losses3, clipped1)
    pg_losses = jnp.where(advantages < 0, clipped2, clipped1)
    if is_weights is not None:
        pg_losses = pg_losses * jax.lax.stop_gradient(is_weights)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon,
                    token_weight=token_weight)
    metrics = {
        "pg_clipfrac": _token_mean((losses2 > losses1).astype(jnp.float32), mask, num_tokens),
        "pg_clipfrac_lower": _token_mean(((clipped1 > losses3) & (advantages < 0)).astype(jnp.float32), mask, num_tokens),
        "ppo_kl": _token_mean(-log_ratio, mask, num_tokens),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def value_loss(values: Float[Array, "b t"], old_values: Float[Array, "b t"], returns: Float[Array, "b t"],
               response_mask: Float[Array, "b t"], cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean",
               *, num_tokens=None, num_seqs=None, horizon=None, token_weight=None) -> tuple[Array, dict[str, Array]]:
    """Clipped value loss 0.5 * agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2)) and vf_clipfrac."""
    clipped = jnp.clip(values, old_values - cliprange_value, old_values + cliprange_value)
    l1 = jnp.square(values - returns)
    l2 = jnp.square(clipped - returns)
    loss = 0.5 * agg_loss(jnp.maximum(l1, l2), response_mask, loss_agg_mode, num_tokens=num_tokens,
                          num_seqs=num_seqs, horizon=horizon, token_weight=token_weight)
    metrics = {"vf_clipfrac": _token_mean((l2 > l1).astype(jnp.float32), response_mask, num_tokens)}
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def entropy_from_logits(logits: Float[Array, "... v"], chunk_size: int | None = None) -> Array:
    """Per-token entropy logsumexp(z) - sum softmax(z) z, in float32; optionally chunked over tokens."""

    def ent(z):
        z = z.astype(jnp.promote_types(z.dtype, jnp.float32))
        lse = jax.nn.logsumexp(z, axis=-1)
        return lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)

    if chunk_size is None:
        return ent(logits)
    lead, v = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, v)
    n = flat.shape[0]
    chunk_size = max(1, min(chunk_size, n))
    pad = (-n) % chunk_size
    flat = jnp.pad(flat, ((0, pad), (0, 0))).reshape(-1, chunk_size, v)
    return jax.lax.map(ent, flat).reshape(-1)[:n].reshape(lead)


def truncated_is_weights(trainer_logprob: Array, rollout_logprob: Array, response_mask: Array,
                         threshold: float = 2.0) -> Array:
    """Token-level truncated importance weights min(pi_trainer / pi_rollout, threshold), no gradient,
    0 at masked tokens: corrects for the rollout engine sampling from a slightly different policy."""
    w = jnp.minimum(jnp.exp(jnp.clip(trainer_logprob - rollout_logprob, -20.0, 20.0)), threshold)
    return jax.lax.stop_gradient(jnp.where(response_mask > 0, w, 0.0))


@jax.jit  # one program, not one per eager op (see jaxppo.ppo.kl.scores_to_token_level)
def rollout_mismatch_metrics(trainer_logprob: Array, rollout_logprob: Array, response_mask: Array) -> dict[str, Array]:
    """How far the engine's sampling distribution is from the trainer's, on the sampled tokens:
    mean / max |p_rollout - p_trainer|, their Pearson correlation, and the mean |log-prob difference|."""
    m = response_mask > 0
    p_t, p_r = jnp.exp(trainer_logprob), jnp.exp(rollout_logprob)
    diff = jnp.abs(p_t - p_r)
    mt, mr = masked_mean(p_t, response_mask), masked_mean(p_r, response_mask)
    cov = masked_mean((p_t - mt) * (p_r - mr), response_mask)
    st = jnp.sqrt(masked_mean((p_t - mt) ** 2, response_mask))
    sr = jnp.sqrt(masked_mean((p_r - mr) ** 2, response_mask))
    return {
        "rollout/probs_diff_mean": masked_mean(diff, response_mask),
        "rollout/probs_diff_max": jnp.max(jnp.where(m, diff, 0.0)),
        "rollout/probs_pearson": cov / jnp.maximum(st * sr, 1e-12),
        "rollout/logprob_diff_mean": masked_mean(jnp.abs(trainer_logprob - rollout_logprob), response_mask),
    }
