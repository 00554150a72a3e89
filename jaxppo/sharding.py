"""The device mesh and the one table that maps logical axis names to mesh axes.

Model code names axes logically (`embed`, `mlp`, `heads`, `kv_heads`, `vocab`, `layers`, ...);
changing the mesh shape is a config edit, never a model edit.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxppo.config.schema import FSDP_GATHER, GRAD_REDUCE_DTYPES
from jaxppo.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or axes). Parameters are sharded over fsdp (ZeRO-3 style) and tensor;
# batches over (data, fsdp). A dimension not divisible by its mesh axes is replicated instead.
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("layers", None),
    ("norm", None),
    ("score", None),
    ("lora", None),  # LoRA rank: small, never sharded
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
)


def resolve_mesh_shape(shape: dict[str, int], num_devices: int) -> dict[str, int]:
    """Fill the single -1 entry so the product is `num_devices`; a clear error when it cannot fit."""
    unknown = [k for k in shape if k not in MESH_AXES]
    if unknown:
        raise ConfigError(f"mesh: unknown axis {unknown}; axes are {list(MESH_AXES)}")
    sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh: at most one axis may be -1, got {free}")
    if any(s == 0 or s < -1 for s in sizes.values()):
        raise ConfigError(f"mesh: axis sizes must be positive or -1, got {sizes}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % fixed:
            raise ConfigError(f"mesh: {sizes} cannot fill {num_devices} devices ({num_devices} is not a multiple of {fixed})")
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        need = math.prod(sizes.values())
        fits = {a: s for a, s in sizes.items() if s > 1}
        one = ", ".join(f"mesh.{a}={num_devices if a == next(iter(fits), None) else 1}" for a in fits)
        raise ConfigError(f"mesh: {sizes} needs {need} devices but {num_devices} are available: run on {need} "
                          f"devices (docs/distributed.md), or set the mesh to these {num_devices} ({one}; an axis of "
                          "-1 takes what is there) and the memory plan says at start whether the run fits them")
    return sizes


def parallel_mode(sizes: Mapping[str, int], fsdp_gather: str, grad_reduce_dtype: str) -> tuple[int, bool, bool]:
    """How an engine's programs use a mesh of these axis sizes (`Mesh.shape`, or the config check's resolved
    sizes): (batch shards = data x fsdp, whether fsdp-sharded parameters are gathered once per update / forward
    pass instead of per layer, whether gradients are summed per device over the micro-batches and reduced across
    devices once per mini-batch). Refuses the combinations that cannot run."""
    if fsdp_gather not in FSDP_GATHER:
        raise ConfigError(f"mesh.fsdp_gather={fsdp_gather!r} unknown; known: {list(FSDP_GATHER)}")
    if fsdp_gather == "update" and sizes["tensor"] > 1:
        raise ConfigError("mesh.fsdp_gather=update needs mesh.tensor=1 (a tensor-parallel layer is never whole "
                          "on one device); use fsdp_gather=layer with tensor parallelism")
    batch_shards = sizes["data"] * sizes["fsdp"]
    gather_once = fsdp_gather == "update" and sizes["fsdp"] > 1
    # every device holds whole parameters while it computes (pure data parallelism, or fsdp gathered once)
    local_accumulation = batch_shards > 1 and sizes["tensor"] == 1 and (sizes["fsdp"] == 1 or gather_once)
    if grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        raise ConfigError(f"mesh.grad_reduce_dtype={grad_reduce_dtype!r} unknown; known: {list(GRAD_REDUCE_DTYPES)}")
    if grad_reduce_dtype != "float32" and not local_accumulation:
        raise ConfigError(f"mesh.grad_reduce_dtype={grad_reduce_dtype} applies where each device holds whole "
                          "parameters (mesh.data > 1 with fsdp = tensor = 1, or mesh.fsdp_gather=update); this "
                          f"mesh is {dict(sizes)}")
    return batch_shards, gather_once, local_accumulation


def make_mesh(shape: dict[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (all devices by default)."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_mesh_shape(shape or {"data": -1}, len(devices))
    grid = np.asarray(devices, dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def _mesh_axes_for(logical: str | None) -> tuple[str, ...]:
    if logical is None:
        return ()
    for name, target in LOGICAL_RULES:
        if name == logical:
            return () if target is None else ((target,) if isinstance(target, str) else tuple(target))
    raise KeyError(f"logical axis {logical!r} has no rule in jaxppo.sharding.LOGICAL_RULES")


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> P:
    """PartitionSpec for an array with these logical axes; axes that do not divide are dropped."""
    used: set[str] = set()
    out = []
    for name, dim in zip(logical, shape):
        axes = tuple(a for a in _mesh_axes_for(name) if mesh.shape[a] > 1 and a not in used)
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            axes = axes[:-1]
        used.update(axes)
        out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return P(*out)


def param_shardings(abstract_boxed: Any, mesh: Mesh) -> Any:
    """Tree of NamedShardings for a tree of `nn.Partitioned` ShapeDtypeStructs (from `jax.eval_shape(init)`)."""

    def one(x):
        if isinstance(x, nn.Partitioned):
            return NamedSharding(mesh, logical_to_spec(x.names, x.value.shape, mesh))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, abstract_boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def batch_sharding(mesh: Mesh, ndim: int = 2, axis: int = 0) -> NamedSharding:
    """Batches are split over (data, fsdp) on their batch axis: the leading one, or `axis` when a
    micro-batch axis comes first ([n_micro, batch, ...])."""
    spec = [None] * ndim
    spec[axis] = ("data", "fsdp")
    return NamedSharding(mesh, P(*spec))


def activation_rules(mesh: Mesh) -> list[tuple[str, Any]]:
    """Rules for `nn.logical_axis_rules` (activation constraints inside the model)."""
    return [(name, tuple(a for a in _mesh_axes_for(name) if mesh.shape[a] > 1) or None) for name, _ in LOGICAL_RULES]
