"""Host offload of the optimizer state (`actor.optimizer_offload`, `critic.optimizer_offload`; verl's
`fsdp_config.optimizer_offload`): AdamW's moments live in the host's pinned memory (JAX memory kind
`pinned_host`) between updates, so a full-parameter run keeps only its fp32 weights on the device while it
generates, scores and runs its forward passes. The update brings the moments to the device inside the compiled
update program, steps, and writes them back (XLA schedules the transfers; each leaf is its own transfer, so they can
overlap the other leaves' arithmetic).

What stays on the device: the parameters, the gradients and the optimizer's scalars (its step count). The memory
plan counts the offloaded bytes against the host's RAM (`host_bytes`) instead of the card (`device_bytes` skips
them).
"""

from __future__ import annotations

from typing import Any

import jax

HOST = "pinned_host"


def is_host(x: Any) -> bool:
    """Whether an array, a ShapeDtypeStruct or a sharding lives in host memory."""
    sharding = x if isinstance(x, jax.sharding.Sharding) else getattr(x, "sharding", None)
    return getattr(sharding, "memory_kind", None) in ("pinned_host", "unpinned_host")


def to_host(shardings: Any, params_like: Any) -> Any:
    """`shardings` of an optimizer state with the leaves shaped like the parameters (`params_like`: a tree of the
    same structure, True where a leaf is one) moved to pinned host memory."""
    return jax.tree.map(lambda s, p: s.with_memory_kind(HOST) if p else s, shardings, params_like)


def fetch(tree: Any, shardings: Any) -> Any:
    """Inside a compiled program: the leaves of `tree` whose sharding (`shardings`, the same structure) is in
    host memory, brought to the device."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind("device")) if is_host(s) else x,
                        tree, shardings)


def store(tree: Any, shardings: Any) -> Any:
    """Inside a compiled program: the leaves of `tree` whose sharding in `shardings` is in host memory, sent back."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s) if is_host(s) else x, tree, shardings)


def host_bytes(tree: Any) -> int:
    """Bytes of `tree`'s host-resident leaves on this host (each addressable shard once)."""
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        if is_host(x):
            shape = x.sharding.shard_shape(np.shape(x))
            local = len(x.sharding.addressable_devices)
            total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize * local
    return total


__all__ = ["HOST", "is_host", "to_host", "fetch", "store", "host_bytes"]
