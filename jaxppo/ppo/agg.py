"""Masked statistics and the one loss aggregation every loss uses.

`agg_loss` takes optional global normalisers (token count, sequence count) so that a mini-batch split
into micro-batches gives, summed, exactly the full mini-batch loss: the engine passes the mini-batch's
counts to every micro-batch and adds the results.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_sum(x: Array, mask: Array, axis=None) -> Array:
    return jnp.sum(jnp.where(mask > 0, x, 0.0), axis=axis)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
    """Mean over valid entries; 0 where there are none (never NaN)."""
    return masked_sum(x, mask, axis) / jnp.maximum(jnp.sum(mask, axis=axis), 1)


def masked_var(x: Array, mask: Array, unbiased: bool = True) -> Array:
    """Variance over valid entries (Bessel-corrected like verl's; 0 with fewer than 2 entries)."""
    n = jnp.sum(mask)
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        var = jnp.where(n > 1, var * n / jnp.maximum(n - 1, 1), 0.0)
    return var


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True, eps: float = 1e-8) -> Array:
    """(x - mean) / sqrt(var + eps) over valid entries; masked entries are 0."""
    mean = masked_mean(x, mask)
    out = (x - mean) * jnp.reciprocal(jnp.sqrt(masked_var(x, mask) + eps))
    if not shift_mean:
        out = out + mean
    return jnp.where(mask > 0, out, 0.0)


def agg_loss(loss_mat: Float[Array, "b t"], mask: Float[Array, "b t"], mode: str = "token-mean", *,
             num_tokens: Array | float | None = None, num_seqs: Array | float | None = None,
             horizon: float | None = None, token_weight: Array | None = None) -> Array:
    """Aggregate a per-token loss matrix to a scalar.

    modes (verl's):
      token-mean                 sum(loss * mask) / num_tokens
      seq-mean-token-sum         sum over sequences of (token sum) / num_seqs
      seq-mean-token-mean        sum over sequences of (token mean) / num_seqs
      seq-mean-token-sum-norm    sum(loss * mask) / (num_seqs * horizon)   (Dr.GRPO: a constant length)
    `num_tokens` / `num_seqs` default to this batch's valid tokens / non-empty sequences; pass the
    mini-batch's to make micro-batch losses add up. `horizon` defaults to the padded length t.
    `token_weight` (packed layout, where a row holds several sequences' tokens): 1 / the length of each
    token's sequence, for seq-mean-token-mean; the other modes only need the sums and the counts.
    """
    mask = mask.astype(loss_mat.dtype)
    seq_valid = (jnp.sum(mask, axis=-1) > 0).astype(loss_mat.dtype)
    if num_tokens is None:
        num_tokens = jnp.sum(mask)
    if num_seqs is None:
        num_seqs = jnp.sum(seq_valid)
    num_tokens = jnp.maximum(num_tokens, 1)
    num_seqs = jnp.maximum(num_seqs, 1)
    token_sum = jnp.sum(jnp.where(mask > 0, loss_mat, 0.0), axis=-1)
    if mode == "token-mean":
        return jnp.sum(token_sum) / num_tokens
    if mode == "seq-mean-token-sum":
        return jnp.sum(token_sum) / num_seqs
    if mode == "seq-mean-token-mean":
        if token_weight is not None:
            return jnp.sum(jnp.where(mask > 0, loss_mat * token_weight, 0.0)) / num_seqs
        return jnp.sum(token_sum / jnp.maximum(jnp.sum(mask, axis=-1), 1)) / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return jnp.sum(token_sum) / (num_seqs * (loss_mat.shape[-1] if horizon is None else horizon))
    raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {list(LOSS_AGG_MODES)}")
