"""KL estimators, the exact vocabulary KL, KL controllers, and KL as a reward penalty.

Estimators take per-token log-probs of the sampled tokens under the current policy and the reference:
  k1 ("kl")          logprob - ref_logprob
  abs                |logprob - ref_logprob|
  k2 ("mse")         0.5 (logprob - ref_logprob)^2
  k3 ("low_var_kl")  exp(ref - logprob) - (ref - logprob) - 1, log-ratio clamped to [-20, 20] and the
                     result to [-10, 10], as verl does
  full               the exact KL(pi || ref) over the vocabulary; takes *logits* [..., vocab] of both
                     models, computed in chunks of tokens so no [tokens, vocab] float32 temporary is
                     larger than one chunk (verl leaves this unimplemented).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxppo.ppo.agg import masked_mean
from jaxppo.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")


@KL_ESTIMATORS.register("k1", "kl")
def _k1(logprob, ref_logprob):
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs")
def _abs(logprob, ref_logprob):
    return jnp.abs(logprob - ref_logprob)


@KL_ESTIMATORS.register("k2", "mse")
def _k2(logprob, ref_logprob):
    return 0.5 * jnp.square(logprob - ref_logprob)


@KL_ESTIMATORS.register("k3", "low_var_kl")
def _k3(logprob, ref_logprob):
    kl = jnp.clip(ref_logprob - logprob, -20.0, 20.0)
    return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)


def _chunked_over_tokens(fn, x: Array, y: Array, chunk_size: int) -> Array:
    """fn over [n, v] rows in chunks of `chunk_size` tokens; returns [...] (the leading shape of x)."""
    lead = x.shape[:-1]
    x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    n = x2.shape[0]
    chunk_size = max(1, min(chunk_size, n))
    pad = (-n) % chunk_size
    x2, y2 = jnp.pad(x2, ((0, pad), (0, 0))), jnp.pad(y2, ((0, pad), (0, 0)))
    shape = (-1, chunk_size, x2.shape[-1])
    out = jax.lax.map(lambda a: fn(*a), (x2.reshape(shape), y2.reshape(shape)))
    return out.reshape(-1)[:n].reshape(lead)


@KL_ESTIMATORS.register("full")
def full_kl(logits: Float[Array, "... v"], ref_logits: Float[Array, "... v"], chunk_size: int = 1024) -> Array:
    """Exact KL(softmax(logits) || softmax(ref_logits)) per token, in float32, chunked over tokens."""

    def kl(a, b):
        f = jnp.promote_types(a.dtype, jnp.float32)  # float64 logits stay float64
        lp = jax.nn.log_softmax(a.astype(f), axis=-1)
        lq = jax.nn.log_softmax(b.astype(f), axis=-1)
        return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)

    return _chunked_over_tokens(kl, logits, ref_logits, chunk_size)


def kl_penalty(logprob: Array, ref_logprob: Array, kind: str = "k1") -> Array:
    """Per-token KL estimate by estimator name (for kind="full", pass logits of both models)."""
    return KL_ESTIMATORS.get(kind)(logprob, ref_logprob)


# ---------------------------------------------------------------- controllers


@dataclasses.dataclass(frozen=True)
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # initial (fixed: constant) coefficient beta
    target_kl: float = 0.1  # adaptive: the KL the coefficient steers towards
    horizon: int = 10000  # adaptive: samples over which a full proportional correction applies


def update_kl_coef(cfg: KLControlConfig, kl_coef: float, current_kl: float, n_steps: int) -> float:
    """The next coefficient. Adaptive (Ziegler et al.): beta *= 1 + clip(kl/target - 1, -0.2, 0.2) * n / horizon."""
    if cfg.type == "fixed":
        return kl_coef
    if cfg.type == "adaptive":
        error = jnp.clip(current_kl / cfg.target_kl - 1.0, -0.2, 0.2)
        return kl_coef * (1.0 + error * n_steps / cfg.horizon)
    raise ValueError(f"unknown kl_ctrl type {cfg.type!r}; known: ['adaptive', 'fixed']")


# ---------------------------------------------------------------- KL in the reward


# jitted: called eagerly once a step, each eager jnp op would be a program of its own to trace, lower and compile
# at every start (nine small programs; docs/benchmarks/ci_time_2026-12-06)
@jax.jit
def scores_to_token_level(scores: Float[Array, "b"], response_mask: Float[Array, "b t"]) -> Array:
    """Place each sequence's scalar score at its last valid response token (rows with none get nothing)."""
    t = response_mask.shape[-1]
    last = jnp.max(jnp.where(response_mask > 0, jnp.arange(t)[None, :], -1), axis=-1)
    return jnp.where(jnp.arange(t)[None, :] == last[:, None], scores[:, None], 0.0).astype(scores.dtype)


@functools.partial(jax.jit, static_argnames="kind")
def apply_kl_penalty(token_level_scores: Array, logprob: Array, ref_logprob: Array, response_mask: Array,
                     kl_coef: float | Array, kind: str = "k1") -> tuple[Array, Array]:
    """token_level_rewards = scores - beta * KL per token (masked), and the batch's mean per-sequence KL
    (the `current_kl` the adaptive controller reads)."""
    kld = jnp.where(response_mask > 0, kl_penalty(logprob, ref_logprob, kind), 0.0)
    rewards = token_level_scores - kl_coef * kld
    current_kl = jnp.mean(masked_mean(kld, response_mask, axis=-1))
    return rewards, current_kl
