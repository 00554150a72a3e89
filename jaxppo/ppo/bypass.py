"""verl's bypass mode (`algorithm.rollout_correction.bypass_mode`; verl 0.9.1's `compute_policy_loss_bypass_mode`):
the rollout engine's log-probs are the old policy's, so the trainer never recomputes them, and the correction for
the gap between the policy that sampled and the one being trained is computed in the loss, per micro-batch, from
the current policy's log-probs (no gradient through it) against the rollout's:

  rollout_is        token | sequence importance weights pi_current / pi_rollout (truncated at the threshold, or
                    zeroed outside "lower_upper"), as `jaxppo.ppo.rollout_correction` defines them on the host
  rollout_rs        rejection options (token_k*, seq_sum_k*, seq_mean_k*, seq_max_k*): rejected tokens leave the
                    loss (its normalisation stays the mini-batch's token / sequence counts, as verl's)
  loss_type         ppo_clip: the clipped PPO loss with the ratio against the rollout (the weights are not applied:
                    the ratio already is the importance ratio); reinforce: -sg(w) A log pi, no ratio, no clip

Both layouts: padded rows (one sequence each) and packed rows (`segment`: each slot's sequence, 1, 2, ...).
tests/ppo/test_verl_oracle.py checks the loss and its gradient against verl's function.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from jaxppo.ppo.agg import agg_loss
from jaxppo.ppo.losses import _token_mean
from jaxppo.ppo.rollout_correction import SAFETY_BOUND, parse_is_threshold, parse_rs


def per_sequence(x: Array, mask: Array, segment: Array | None, op: str) -> Array:
    """Each token's sequence's sum ("sum") or max ("max") of `x` over its valid tokens, at every token."""
    valid = mask > 0
    v = jnp.where(valid, x, 0.0) if op == "sum" else jnp.where(valid, x, -jnp.inf)
    if segment is None:
        red = jnp.sum(v, -1, keepdims=True) if op == "sum" else jnp.max(v, -1, keepdims=True)
        return jnp.broadcast_to(red, x.shape)
    n = x.shape[-1] + 1
    seg = jax.ops.segment_sum if op == "sum" else jax.ops.segment_max
    return jax.vmap(lambda vr, sr: seg(vr, sr, num_segments=n)[sr])(v, segment)


def weights_and_mask(logp: Array, rollout_lp: Array, mask: Array, rc: Any, segment: Array | None = None
                     ) -> tuple[Array | None, Array]:
    """(importance weights or None, the mask without rejected tokens), from the current log-probs (no gradient)
    against the rollout's."""
    lr = jax.lax.stop_gradient(logp) - rollout_lp
    m = mask.astype(lr.dtype)
    weights = None
    if rc.rollout_is is not None:
        upper, lower = parse_is_threshold(rc.rollout_is_threshold)
        level = lr if rc.rollout_is == "token" else per_sequence(lr, m, segment, "sum")
        raw = jnp.exp(jnp.clip(level, -SAFETY_BOUND, SAFETY_BOUND)) * m
        weights = jnp.minimum(raw, upper) if lower is None else jnp.where((raw >= lower) & (raw <= upper), raw, 0.0)
    keep = jnp.ones_like(m)
    if rc.rollout_rs is not None:
        c = jnp.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)
        stats = {"k1": -c, "k2": 0.5 * c ** 2, "k3": jnp.exp(c) - 1.0 - c}
        count = per_sequence(jnp.ones_like(m), m, segment, "sum")
        for option, (lo, hi) in parse_rs(rc.rollout_rs, rc.rollout_rs_threshold).items():
            stat = stats[option[-2:]]
            if option.startswith("token"):
                per_tok = stat
            elif option.startswith("seq_sum"):
                per_tok = per_sequence(stat, m, segment, "sum")
            elif option.startswith("seq_mean"):
                per_tok = per_sequence(stat, m, segment, "sum") / (count + 1e-8)
            else:  # seq_max
                mx = per_sequence(stat, m, segment, "max")
                per_tok = jnp.where(jnp.isneginf(mx), 0.0, mx)
            ok = (per_tok >= jnp.log(lo)) & (per_tok <= jnp.log(hi)) if option.endswith("k1") else per_tok <= hi
            keep = keep * ok.astype(m.dtype)
    return weights, m * keep


def bypass_policy_loss(rc: Any, rollout_lp: Array, logp: Array, adv: Array, mask: Array, actor_cfg: Any,
                       mode: str = "token-mean", *, segment: Array | None = None, **norm
                       ) -> tuple[Array, dict[str, Array]]:
    """The actor's policy loss in bypass mode (`rc`: the algorithm.rollout_correction config) and its metrics."""
    from jaxppo.ppo.policy_losses import compute_policy_loss

    weights, kept = weights_and_mask(logp, rollout_lp, mask, rc, segment)
    if rc.loss_type == "ppo_clip":
        return compute_policy_loss("vanilla", rollout_lp, logp, adv, kept, actor_cfg, mode, segment=segment, **norm)
    w = 1.0 if weights is None else jax.lax.stop_gradient(weights)
    loss = agg_loss(-adv * logp * w, kept, mode, **norm)
    zero = jnp.zeros((), logp.dtype)
    metrics = {"pg_clipfrac": zero, "pg_clipfrac_lower": zero,
               "ppo_kl": _token_mean(rollout_lp - logp, kept, norm.get("num_tokens"))}
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


__all__ = ["bypass_policy_loss", "weights_and_mask", "per_sequence"]
