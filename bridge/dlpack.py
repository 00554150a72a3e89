"""JAX array -> torch tensor without a copy (DLPack), per-shard aware.

`to_torch(x)` waits for `x` to be computed, then hands its buffer to torch: same memory, same pointer
(asserted in the tests). An array sharded over several devices is first gathered onto one device
(one parameter at a time, so the peak extra memory is one parameter). A torch view must not outlive
the JAX buffer's owner's next donation: `iter_torch_weights` (over `jaxppo.models.hf_io.export_hf_arrays`)
produces fresh buffers (cast / layer slice on device) that the train state never donates, and is meant
to be consumed during one update.
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
import torch

from jaxppo.models.hf_io import export_hf_arrays


def _local_single_device(x: jax.Array) -> jax.Array:
    """`x` whole on one local device: itself when it already is, else gathered (replicated) first."""
    if len(x.sharding.device_set) == 1:
        return x
    if x.is_fully_replicated:
        return x.addressable_shards[0].data
    mesh = getattr(x.sharding, "mesh", None)
    if mesh is None:
        return jax.device_put(x, jax.local_devices()[0])
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(lambda a: a, out_shardings=replicated)(x).addressable_shards[0].data


def to_torch(x: jax.Array) -> torch.Tensor:
    """Zero-copy view of a (gathered) JAX array as a torch tensor on the same device."""
    x = _local_single_device(x)
    x.block_until_ready()  # JAX dispatch is asynchronous: the buffer may still be being written
    return torch.from_dlpack(x)


def jax_pointer(x: jax.Array) -> int:
    """Device address of a single-device JAX array's buffer (for zero-copy assertions)."""
    return x.addressable_shards[0].data.unsafe_buffer_pointer()


def iter_torch_weights(params: Any, dtype: Any = jnp.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, torch tensor) pairs, each a zero-copy view of a fresh JAX buffer."""
    for name, arr in export_hf_arrays(params, dtype):
        yield name, to_torch(arr)
