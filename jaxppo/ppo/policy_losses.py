"""Policy losses under verl's names (`actor.policy_loss.loss_mode`, verl's
`actor_rollout_ref.actor.policy_loss.loss_mode`), each equal to verl 0.9.1's function of that name in float64
(tests/ppo/test_verl_oracle.py) where verl normalises by the mini-batch:

  vanilla   the clipped PPO surrogate with dual clip (jaxppo.ppo.losses.policy_loss)
  gspo      GSPO (arXiv:2507.18071): the sequence's geometric-mean ratio, clipped, with each token's own gradient
  gpg       GPG: -A log pi (no ratio, no clip)
  cispo     CISPO (arXiv:2506.13585): -sg(clip(ratio)) A log pi
  sapo      SAPO (arXiv:2511.20347): a sigmoid gate of the ratio instead of the clip (seq-mean-token-mean always)
  geo_mean  GMPO (arXiv:2507.20673): the sequence's geometric mean of token ratios clipped in log space, per
            sequence, averaged over the mini-batch's sequences (verl averages each micro-batch's rows: see
            docs/verl_keys.md)
  kl_cov    KL-Cov: the tokens of the largest advantage x log-prob covariance (a `kl_cov_ratio` of the
            micro-batch's tokens) get an |log ratio| penalty
  clip_cov  Clip-Cov: of the tokens with covariance in (lb, ub) that the clip did not catch, up to
            `clip_cov_ratio` of the micro-batch's tokens lose their gradient (verl draws them at random; jaxppo
            takes those of the largest covariance, so runs repeat)
  dro       DRO: -(A log pi - beta / 2 (log ratio)^2)

Every loss takes the same arguments; `segment` (packed rows: the slot's sequence within its row, 1, 2, ...; None
for padded rows, one sequence each) and `token_weight` (1 / the token's sequence's length) let the sequence-level
losses find each token's sequence in either layout.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array

from jaxppo.ppo.agg import agg_loss, masked_mean, masked_sum
from jaxppo.ppo.losses import _token_mean, policy_loss
from jaxppo.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")


def seq_mean_per_token(x: Array, mask: Array, segment: Array | None) -> Array:
    """Each token's sequence's mean of `x` over its valid tokens, at every token ([b, t] -> [b, t])."""
    m = (mask > 0).astype(x.dtype)
    if segment is None:
        return (jnp.sum(x * m, -1) / jnp.maximum(jnp.sum(m, -1), 1.0))[:, None] * jnp.ones_like(x)
    n = x.shape[-1] + 1

    def row(xr, mr, sr):
        sums = jax.ops.segment_sum(xr * mr, sr, num_segments=n)
        counts = jax.ops.segment_sum(mr, sr, num_segments=n)
        return (sums / jnp.maximum(counts, 1.0))[sr]

    return jax.vmap(row)(x, m, segment)


def _finish(pg_losses, mask, mode, is_weights, norm, metrics):
    if is_weights is not None:
        pg_losses = pg_losses * jax.lax.stop_gradient(is_weights)
    loss = agg_loss(pg_losses, mask, mode, **norm)
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def _zero(mask):
    return jnp.zeros((), mask.dtype)


@POLICY_LOSSES.register("vanilla")
def vanilla(old, logp, adv, mask, c, mode, *, is_weights, segment, **norm):
    return policy_loss(old, logp, adv, mask, c.clip_ratio_low, c.clip_ratio_high, c.clip_ratio_c, mode,
                       is_weights=is_weights, **norm)


@POLICY_LOSSES.register("gspo")
def gspo(old, logp, adv, mask, c, mode, *, is_weights, segment, **norm):
    nt = norm.get("num_tokens")
    log_ratio = logp - old
    seq = jax.lax.stop_gradient(seq_mean_per_token(log_ratio, mask, segment))
    log_seq_ratio = jnp.minimum(logp - jax.lax.stop_gradient(logp) + seq, 10.0)
    ratio = jnp.exp(log_seq_ratio)
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - c.clip_ratio_low, 1.0 + c.clip_ratio_high)
    metrics = {"pg_clipfrac": _token_mean((l2 > l1).astype(mask.dtype), mask, nt), "pg_clipfrac_lower": _zero(mask),
               "ppo_kl": _token_mean(-log_ratio, mask, nt)}
    return _finish(jnp.maximum(l1, l2), mask, mode, is_weights, norm, metrics)


@POLICY_LOSSES.register("gpg")
def gpg(old, logp, adv, mask, c, mode, *, is_weights, segment, **norm):
    nt = norm.get("num_tokens")
    metrics = {"pg_clipfrac": _zero(mask), "pg_clipfrac_lower": _zero(mask), "ppo_kl": _token_mean(old - logp, mask, nt)}
    return _finish(-logp * adv, mask, mode, is_weights, norm, metrics)


@POLICY_LOSSES.register("cispo")
def cispo(old, logp, adv, mask, c, mode, *, is_weights, segment, **norm):
    nt = norm.get("num_tokens")
    log_ratio = jnp.clip(logp - old, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - c.clip_ratio_low, 1.0 + c.clip_ratio_high)
    metrics = {"pg_clipfrac": _token_mean((ratio != clipped).astype(mask.dtype), mask, nt),
               "pg_clipfrac_lower": _zero(mask), "ppo_kl": _token_mean(-log_ratio, mask, nt)}
    return _finish(-jax.lax.stop_gradient(clipped) * adv * logp, mask, mode, is_weights, norm, metrics)


@POLICY_LOSSES.register("sapo")
def sapo(old, logp, adv, mask, c, mode, *, is_weights, segment, **norm):
    nt = norm.get("num_tokens")
    log_ratio = jnp.clip(logp - old, -20.0, 20.0)
    tau = jnp.where(adv > 0, c.tau_pos, c.tau_neg)
    gate = jax.nn.sigmoid(tau * (jnp.exp(log_ratio) - 1.0)) * (4.0 / tau)
    metrics = {"pg_clipfrac": _zero(mask), "pg_clipfrac_lower": _zero(mask), "ppo_kl": _token_mean(-log_ratio, mask, nt)}
    return _finish(-gate * adv, mask, "seq-mean-token-mean", is_weights, norm, metrics)  # verl: always this mode


@POLICY_LOSSES.register("geo_mean")
def geo_mean(old, logp, adv, mask, c, mode, *, is_weights, segment, **norm):
    nt, ns = norm.get("num_tokens"), norm.get("num_seqs")
    log_ratio = logp - old
    sgn = jnp.sign(adv)
    clamped = jnp.clip(log_ratio, -c.clip_ratio_low, c.clip_ratio_high)
    kept = sgn * jnp.minimum(sgn * log_ratio, sgn * clamped)
    ratio = jnp.exp(seq_mean_per_token(kept, mask, segment))
    seq_adv = seq_mean_per_token(adv, mask, segment)
    per_seq = -seq_adv * ratio
    if is_weights is not None:
        per_seq = per_seq * jnp.exp(seq_mean_per_token(jnp.log(jax.lax.stop_gradient(is_weights) + 1e-10), mask,
                                                       segment))
    # a per-sequence loss at each of its tokens, weighted 1 / its length: the token sum is the sum over sequences
    weight = norm.get("token_weight")
    if weight is None:
        weight = 1.0 / jnp.maximum(jnp.sum(mask, -1, keepdims=True), 1.0)
    seqs = jnp.sum((jnp.sum(mask, -1) > 0).astype(mask.dtype)) if ns is None else ns
    loss = masked_sum(per_seq * weight, mask) / jnp.maximum(seqs, 1)
    clipped = (log_ratio != clamped).astype(mask.dtype)
    metrics = {"pg_clipfrac": _token_mean(clipped * (adv > 0), mask, nt),
               "pg_clipfrac_lower": _token_mean(clipped * (adv < 0), mask, nt),
               "ppo_kl": _token_mean(-log_ratio, mask, nt)}
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def _top_tokens(score: Array, eligible: Array, k: Array) -> Array:
    """A [b, t] 0/1 mask of the `k` eligible tokens of the largest score (k a traced count; ties: the first)."""
    flat = jnp.where(eligible, score, -jnp.inf).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(flat.size))
    return ((rank < k) & (flat > -jnp.inf)).reshape(score.shape)


def _covariance(adv, logp, mask):
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(jax.lax.stop_gradient(logp), mask))


@POLICY_LOSSES.register("kl_cov")
def kl_cov(old, logp, adv, mask, c, mode, *, is_weights, segment, **norm):
    p = c.policy_loss
    log_ratio = logp - old
    ratio = jnp.exp(log_ratio)
    valid = mask > 0
    k = jnp.maximum(1, jnp.floor(jnp.sum(valid) * p.kl_cov_ratio)).astype(jnp.int32)
    top = _top_tokens(jax.lax.stop_gradient(_covariance(adv, logp, mask)), valid, k)
    pg = -adv * ratio + jnp.where(top, p.ppo_kl_coef * jnp.abs(log_ratio), 0.0)
    metrics = {"pg_clipfrac": _zero(mask), "pg_clipfrac_lower": _zero(mask),
               "ppo_kl": masked_mean(jnp.abs(log_ratio), mask)}  # verl logs |log ratio| here
    return _finish(pg, mask, mode, is_weights, norm, metrics)


@POLICY_LOSSES.register("clip_cov")
def clip_cov(old, logp, adv, mask, c, mode, *, is_weights, segment, **norm):
    p = c.policy_loss
    log_ratio = logp - old
    ratio = jnp.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - c.clip_ratio_low, 1.0 + c.clip_ratio_high)
    valid = mask > 0
    cov = jax.lax.stop_gradient(_covariance(adv, logp, mask))
    eligible = valid & ~(l2 > l1) & (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub)
    k = jnp.maximum(1, jnp.floor(p.clip_cov_ratio * jnp.sum(valid))).astype(jnp.int32)
    drop = _top_tokens(cov, eligible, k)
    metrics = {"pg_clipfrac": masked_mean(drop.astype(mask.dtype), mask), "pg_clipfrac_lower": _zero(mask),
               "ppo_kl": masked_mean(-log_ratio, mask)}
    return _finish(jnp.maximum(l1, l2) * (1.0 - drop), mask, mode, is_weights, norm, metrics)


@POLICY_LOSSES.register("dro")
def dro(old, logp, adv, mask, c, mode, *, is_weights, segment, **norm):
    log_ratio = logp - old
    beta = c.policy_loss.dro_beta
    metrics = {"pg_clipfrac": _zero(mask), "pg_clipfrac_lower": _zero(mask),
               "ppo_kl": _token_mean(-log_ratio, mask, norm.get("num_tokens"))}
    return _finish(-(logp * adv - 0.5 * beta * jnp.square(log_ratio)), mask, mode, is_weights, norm, metrics)


def compute_policy_loss(name: str, old: Array, logp: Array, adv: Array, mask: Array, actor_cfg: Any,
                        mode: str = "token-mean", *, is_weights: Array | None = None, segment: Array | None = None,
                        **norm) -> tuple[Array, dict[str, Array]]:
    """The policy loss registered as `name`, with the actor config's clip bounds and `policy_loss` settings."""
    fn: Callable = POLICY_LOSSES.get(name)
    return fn(old, logp, adv, mask, actor_cfg, mode, is_weights=is_weights, segment=segment, **norm)


__all__ = ["POLICY_LOSSES", "compute_policy_loss", "seq_mean_per_token"]
