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
from flax import traverse_util

from jaxppo.models.hf_io import _export_layer, export_hf_arrays, hf_name, is_stacked


def _whole_here(x: jax.Array) -> jax.Array | None:
    """`x` whole on one local device without a copy (itself, or one replica), else None."""
    if len(x.sharding.device_set) == 1:
        return x
    if x.is_fully_replicated:
        return x.addressable_shards[0].data
    return None


def layer_views(path: tuple, whole: jax.Array) -> list[torch.Tensor]:
    """Torch views of a parameter whole on one device: its layers when stacked, else itself."""
    t = torch.from_dlpack(whole)
    return list(t.unbind(0)) if is_stacked(path) else [t]


def _local_single_device(x: jax.Array) -> jax.Array:
    """`x` whole on one local device: itself when it already is, else gathered (replicated) first."""
    whole = _whole_here(x)
    if whole is not None:
        return whole
    mesh = getattr(x.sharding, "mesh", None)
    if mesh is None:
        return jax.device_put(x, jax.local_devices()[0])
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(lambda a: a, out_shardings=replicated)(x).addressable_shards[0].data


def to_torch(x: jax.Array | torch.Tensor) -> torch.Tensor:
    """Zero-copy view of a (gathered) JAX array as a torch tensor on the same device (a torch tensor: itself)."""
    if isinstance(x, torch.Tensor):
        return x
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


def hf_views(params: Any) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(HF name, torch tensor, borrowed) for every tensor, in the parameters' own dtype.

    A parameter whole on one device (single device, or replicated) is handed over as a DLPack view of
    the train state's own buffer, a stacked parameter's layer as a torch view into it: nothing is
    copied or allocated (`borrowed` True). These views alias buffers the next update donates: copy
    from them and synchronise before that update. A parameter sharded over several devices is gathered
    one layer at a time into a fresh buffer instead (`borrowed` False): the consumer copies it and
    drops it before asking for the next, so the extra memory stays one layer."""
    flat = traverse_util.flatten_dict(params)
    jax.block_until_ready(list(flat.values()))  # JAX dispatch is asynchronous
    for path, value in flat.items():
        whole = _whole_here(value)
        if whole is not None:
            views = layer_views(path, whole)
            yield from ((hf_name(path, i if is_stacked(path) else None), v, True) for i, v in enumerate(views))
        elif is_stacked(path):
            for i in range(value.shape[0]):
                yield hf_name(path, i), to_torch(_export_layer(value, i, None)), False
        else:
            yield hf_name(path), to_torch(value), False
