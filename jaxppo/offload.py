"""Host offload of the optimizer state (`actor.optimizer_offload`, `critic.optimizer_offload`; verl's
`fsdp_config.optimizer_offload`): AdamW's moments live in the host's pinned memory (JAX memory kind
`pinned_host`) between updates, so a full-parameter run keeps only its fp32 weights on the device while it
generates, scores and runs its forward passes. The optimizer step inside the compiled update program (`step`) goes one
parameter at a time: it brings that parameter's moments to the device, steps it, and sends them back before the next
parameter's come in (an optimization barrier orders each fetch after the previous store), so the card holds one
parameter's moments at a time (Qwen2.5-7B: its largest stacked weight, 2 x 7.6 GB) instead of all of them (61 GB).
Gradient clipping, which needs the norm over every gradient, runs first on the whole tree.

What stays on the device: the parameters, the gradients and the optimizer's scalars (its step count). The memory
plan counts the offloaded bytes against the host's RAM (`host_bytes`) instead of the card (`device_bytes` skips
them).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

HOST = "pinned_host"


def is_host(x: Any) -> bool:
    """Whether an array, a ShapeDtypeStruct or a sharding lives in host memory."""
    sharding = x if isinstance(x, jax.sharding.Sharding) else getattr(x, "sharding", None)
    return getattr(sharding, "memory_kind", None) in ("pinned_host", "unpinned_host")


def host_resident_bytes() -> int:
    """Bytes of this process's live JAX arrays in host memory, as they are now (the offloaded states, and anything
    else alive there): what the memory plan's host figure is measured against. Each buffer once: an array's
    per-device shards are arrays too, over the same buffers."""
    seen: dict[tuple[int, int], int] = {}
    for a in jax.live_arrays():
        if is_host(a):
            for s in a.addressable_shards:
                seen[(s.device.id, s.data.unsafe_buffer_pointer())] = s.data.nbytes
    return sum(seen.values())


def to_host(shardings: Any, params_like: Any) -> Any:
    """`shardings` of an optimizer state with the leaves shaped like the parameters (`params_like`: a tree of the
    same structure, True where a leaf is one) moved to pinned host memory."""
    return jax.tree.map(lambda s, p: s.with_memory_kind(HOST) if p else s, shardings, params_like)


def step(parts: tuple[optax.GradientTransformation, optax.GradientTransformation], grads: Any, opt_state: Any,
         params: Any, shardings: Any) -> tuple[Any, Any]:
    """Inside a compiled program: one step of `optax.chain(*parts)` (the clip on the whole tree, then the elementwise
    optimizer) with `opt_state`'s host-resident moments streamed through the device one parameter at a time.
    Returns (new params, new state); the same arithmetic as `tx.update` + `optax.apply_updates` on the whole tree."""
    clip, inner = parts
    clip_state, inner_state = opt_state
    grads, clip_state = clip.update(grads, clip_state, params)
    treedef = jax.tree.structure(params)
    shaped = lambda x: jax.tree.structure(x) == treedef  # noqa: E731 - a params-shaped part of the state (a moment)
    flat, state_def = jax.tree.flatten(inner_state, is_leaf=shaped)
    flat_sh = jax.tree.flatten(shardings[1], is_leaf=shaped)[0]
    cols = [treedef.flatten_up_to(x) if shaped(x) else None for x in flat]  # per state part: its leaves, in order
    col_sh = [treedef.flatten_up_to(s) if c is not None else None for c, s in zip(cols, flat_sh)]
    p_leaves, g_leaves = treedef.flatten_up_to(params), treedef.flatten_up_to(grads)
    is_moment = [c is not None for c in cols]
    new_p, new_cols, stored = [], [[] for _ in flat], None
    for k, (p, g) in enumerate(zip(p_leaves, g_leaves)):
        mine = [c[k] for c in cols if c is not None]
        if stored is not None:  # this parameter's moments come in after the previous one's went out
            mine, p, g, _ = jax.lax.optimization_barrier((mine, p, g, stored))
        sh = [s[k] for s in col_sh if s is not None]
        p, moments, scalars = _leaf_step(inner, state_def, is_moment, flat, p, g,
                                         [_device(x, s) for x, s in zip(mine, sh)], sh[0] if sh else None)
        new_p.append(p)
        stored = [jax.device_put(x, s) if is_host(s) else x for x, s in zip(moments, sh)]
        it, its = iter(stored), iter(scalars)
        for i, m in enumerate(is_moment):
            if m:
                new_cols[i].append(next(it))
            else:
                new_cols[i] = next(its)  # the step count: every parameter's step counts from the same one
    parts_out = [treedef.unflatten(c) if cols[i] is not None else c for i, c in enumerate(new_cols)]
    return treedef.unflatten(new_p), (clip_state, jax.tree.unflatten(state_def, parts_out))


def _leaf_step(inner: optax.GradientTransformation, state_def: Any, is_moment: list[bool], flat: list[Any], p: Any,
               g: Any, moments: list[Any], sharding: Any) -> tuple[Any, list[Any], list[Any]]:
    """One parameter's step on the device: (new parameter, its new moments, the state's new scalars). A parameter
    over CHUNK_BYTES steps a slice at a time, written back in place, so the step holds the parameter, its gradient
    and its moments, and a slice's worth of intermediates (XLA does not update a whole leaf's moments in place)."""

    def run(p, g, moments):
        it = iter(moments)
        sub = [[next(it)] if m else x for m, x in zip(is_moment, flat)]
        update, sub = inner.update([g], jax.tree.unflatten(state_def, sub), [p])
        out = jax.tree.flatten(sub, is_leaf=lambda x: isinstance(x, list))[0]
        return (optax.apply_updates([p], update)[0], [x[0] for m, x in zip(is_moment, out) if m],
                [x for m, x in zip(is_moment, out) if not m])

    axis, size = _slices(p, sharding)
    if axis is None:
        return run(p, g, moments)

    def body(i, carry):
        p, moments, _ = carry
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, i * size, size, axis)  # noqa: E731
        new_p, new_moments, scalars = run(take(p), take(g), [take(m) for m in moments])
        put = lambda x, v: jax.lax.dynamic_update_slice_in_dim(x, v, i * size, axis)  # noqa: E731
        return put(p, new_p), [put(m, v) for m, v in zip(moments, new_moments)], scalars

    scalars = [x for m, x in zip(is_moment, flat) if not m]
    return jax.lax.fori_loop(0, p.shape[axis] // size, body, (p, moments, scalars))


CHUNK_BYTES = 256 << 20  # the slice a large parameter steps at a time (module-level: tests shrink it)


def _slices(p: Any, sharding: Any) -> tuple[int | None, int]:
    """(axis, slice length) to step `p` by: its first axis no mesh axis shards, the longest slice that divides it
    within CHUNK_BYTES; (None, 0) when `p` is small enough to step whole."""
    import numpy as np

    nbytes = int(np.prod(p.shape, dtype=np.int64)) * np.dtype(p.dtype).itemsize
    if nbytes <= CHUNK_BYTES:
        return None, 0
    spec = tuple(getattr(sharding, "spec", ()) or ())
    for axis, n in enumerate(p.shape):
        if n > 1 and (axis >= len(spec) or spec[axis] is None):
            per = nbytes // n
            size = max((d for d in range(1, n + 1) if n % d == 0 and d * per <= CHUNK_BYTES), default=1)
            return (axis, size) if size < n else (None, 0)
    return None, 0


def _device(x: Any, sharding: Any) -> Any:
    return jax.device_put(x, sharding.with_memory_kind("device")) if is_host(sharding) else x


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


__all__ = ["HOST", "is_host", "to_host", "step", "host_bytes", "host_resident_bytes"]
