"""Reward-model scoring: a Flax critic-style model (backbone + scalar head) loaded from a Hugging Face
token-classification checkpoint (num_labels=1), read at the last valid token of each sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxppo.models import load_model, positions_from_mask


class RewardModel:
    def __init__(self, model_dir: str | Path, *, mesh: Any = None, dtype: Any = jnp.float32):
        self.module, self.params, self.cfg = load_model(model_dir, "value", mesh=mesh, dtype=dtype)
        self._score = jax.jit(self._score_impl)

    def _score_impl(self, params, input_ids, attention_mask):
        values = self.module.apply({"params": params}, input_ids, positions_from_mask(attention_mask), attention_mask)
        last = input_ids.shape[1] - 1 - jnp.argmax(attention_mask[:, ::-1], axis=1)
        return jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]

    def score(self, input_ids: Int[Array, "b t"], attention_mask: Int[Array, "b t"]) -> Float[Array, "b"]:
        """Scalar reward per sequence (prompt + response, left- or right-padded) at its last valid token."""
        return self._score(self.params, jnp.asarray(input_ids), jnp.asarray(attention_mask))
