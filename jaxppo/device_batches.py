"""Batches on the mesh: host arrays to global device arrays sharded over (data, fsdp), token-budget packing
(`jaxppo/packing.py`) with the shapes agreed between processes, and the micro-batch split inside a jitted step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxppo.sharding import batch_sharding

Batch = dict[str, jax.Array]


def split_micro(batch: Batch, n_micro: int, mesh: Mesh) -> Batch:
    """[b, ...] -> [n_micro, b / n_micro, ...], each micro-batch spread over all batch shards (strided)."""

    def one(x):
        b = x.shape[0]
        return jnp.swapaxes(x.reshape((b // n_micro, n_micro) + x.shape[1:]), 0, 1)

    return constrain_micro(jax.tree.map(one, batch), mesh)


def constrain_micro(batch: Batch, mesh: Mesh) -> Batch:
    """[n_micro, batch, ...] arrays: the batch axis (rows, or packed rows / slots) over (data, fsdp)."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim, axis=1)), batch)


def merge_micro(x: jax.Array) -> jax.Array:
    """Inverse of `split_micro` for one array."""
    n, m = x.shape[:2]
    return jnp.swapaxes(x, 0, 1).reshape((n * m,) + x.shape[2:])



class DeviceBatches:
    """The engines' batch plumbing (mixed into `jaxppo.engine._Base`: uses its mesh, batch shards and response
    length)."""

    def _n_micro(self, b: int, per_device: int) -> int:
        micro = per_device * self.batch_shards
        if b % micro:
            raise ValueError(f"batch of {b} sequences is not a multiple of the micro-batch "
                             f"({per_device} per device x {self.batch_shards} batch shards = {micro})")
        return b // micro

    def _micro_batches(self, batch: Batch, per_device: int) -> Batch:
        """[n_micro, ...] micro-batches: a packed batch (jaxppo/packing.py) arrives split already."""
        if "gather_idx" in batch:
            return constrain_micro(batch, self.mesh)
        return split_micro(batch, self._n_micro(batch["input_ids"].shape[0], per_device), self.mesh)

    @property
    def attention_window(self) -> int | None:
        """The longest sequence the engine's model sees (its `attention_window`): what cuts packed rows into
        attention windows (jaxppo/packing.py)."""
        return getattr(self.module, "attention_window", None)

    def pack(self, batch: dict[str, np.ndarray], budget: int, what: str):
        """This process's rows of a padded host batch packed into one row per local batch shard and
        micro-batch; with several processes the shapes are agreed on (the largest bucket wins)."""
        from jaxppo import distributed as dist
        from jaxppo.packing import pack

        k = jax.process_count()
        if self.batch_shards % k:
            raise ValueError(f"{self.batch_shards} batch shards do not split over {k} processes")
        local = self.batch_shards // k
        known = self._packed_shapes.setdefault(what, set())
        caps = self._shape_caps.get(what)
        window = self.attention_window
        packed = pack(batch, self.response_length, budget, local, what, known=known, caps=caps, window=window)
        while k > 1:  # every process the same shapes: repeat with the largest until all agree (they only grow)
            keys = dist.gather_rows(np.array([packed.shape_key]))
            n, s, row, runs = (int(v) for v in keys.max(0))
            if (keys == (n, s, row, runs)).all():
                break
            packed = pack(batch, self.response_length, budget, local, what, min_micro=n, min_slots=s, row_len=row,
                          min_runs=runs, known=known, caps=caps, window=window)
        known.add(packed.shape_key)
        return packed

    def hold_to_plan(self, shapes: dict[str, tuple[int, int, int, int]]) -> None:
        """Pack each budget's batches within the shape the memory plan compiled for it (`shapes`: budget key ->
        (micro-batches, slots, row length, runs), `jaxppo.plan.Plan.packed_shapes`): that program is reused when it
        costs little more than the best layout, and no row holds more slots, tokens or runs than it."""
        from jaxppo.packing import Caps

        for what, key in shapes.items():
            self._packed_shapes.setdefault(what, set()).add(key)
            self._shape_caps[what] = Caps.of(key)

    def shard_packed(self, packed) -> Batch:
        """A `jaxppo.packing.Packed` batch (this process's rows) -> global device arrays, rows / slots
        spread over (data, fsdp)."""
        self.compiled_shapes.add(packed.shape_key)
        return self._to_global(packed.arrays, axis=1)

    def shard_batch(self, batch: dict[str, np.ndarray]) -> Batch:
        """Host arrays -> global arrays sharded over (data, fsdp) (this process's rows when multi-process)."""
        return self._to_global(batch, axis=0)

    def _to_global(self, batch: dict[str, np.ndarray], axis: int) -> Batch:
        out = {}
        for k, v in batch.items():
            sharding = batch_sharding(self.mesh, np.ndim(v), axis)
            if jax.process_count() > 1:
                out[k] = jax.make_array_from_process_local_data(sharding, np.asarray(v))
            else:
                out[k] = jax.device_put(np.asarray(v), sharding)
        return out
