"""Hugging Face checkpoints <-> Flax parameters.

Loading reads `config.json` and safetensors (one file or a sharded `model.safetensors.index.json`)
tensor by tensor, and for each parameter asks only for the slice each device owns
(`jax.make_array_from_callback` + safetensors' lazy `get_slice`), so no device ever holds a full
unsharded copy and the host holds at most one parameter's shard at a time.
Writing produces safetensors + config.json that transformers and vLLM load.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxppo.errors import CheckpointError
from jaxppo.models.config import ModelConfig

Params = dict[str, Any]
LAYER_PREFIX = ("model", "layers")


def hf_name(path: tuple[str, ...], layer: int | None = None) -> str:
    """Flax parameter path (+ layer index for stacked layers) -> Hugging Face tensor name."""
    if path[:2] == LAYER_PREFIX:
        return ".".join(("model", "layers", str(layer)) + path[2:])
    return ".".join(path)


def is_stacked(path: tuple[str, ...]) -> bool:
    return path[:2] == LAYER_PREFIX


def iter_hf_names(path: tuple[str, ...], num_layers: int) -> list[str]:
    return [hf_name(path, i) for i in range(num_layers)] if is_stacked(path) else [hf_name(path)]


class SafetensorsIndex:
    """Which file holds which tensor, for single-file and sharded checkpoints."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from None
            self.files = {name: self.dir / fname for name, fname in weight_map.items()}
        elif single.is_file():
            self.files = {name: single for name in self._keys(single)}
        else:
            raise CheckpointError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self._handles: dict[Path, Any] = {}

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safe_open(str(path), framework="numpy") as f:
                return list(f.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None

    def handle(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        path = self.files[name]
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in the index for {name!r} but the file does not exist")
            try:
                self._handles[path] = safe_open(str(path), framework="numpy")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handle(name).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        return self.handle(name).get_slice(name)[index] if index else self.handle(name).get_tensor(name)


def _check_shapes(idx: SafetensorsIndex, path: tuple[str, ...], shape: tuple[int, ...], num_layers: int):
    per_tensor = shape[1:] if is_stacked(path) else shape
    for name in iter_hf_names(path, num_layers):
        got = idx.shape(name)
        if got != tuple(per_tensor):
            raise CheckpointError(f"{idx.dir}: tensor {name!r} has shape {list(got)}, "
                                  f"but config.json implies {list(per_tensor)}")


def _reader(idx: SafetensorsIndex, path: tuple[str, ...], shape: tuple[int, ...], dtype: Any):
    """Callback for `make_array_from_callback`: reads only the requested slice from disk."""

    def read(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if is_stacked(path):
            layers = range(*index[0].indices(shape[0]))
            parts = [idx.read(hf_name(path, i), index[1:]) for i in layers]
            return np.stack(parts).astype(dtype)
        return np.asarray(idx.read(hf_name(path), index)).astype(dtype)

    return read


def load_params(model_dir: str | Path, abstract: Params, num_layers: int, shardings: Any = None,
                skip: tuple[tuple[str, ...], ...] = ()) -> Params:
    """Read a checkpoint into the parameter tree described by `abstract` (ShapeDtypeStructs).

    `shardings`: a tree of `jax.sharding.Sharding` like `abstract` (None: the default device).
    `skip`: parameter paths not read from disk (returned as None, e.g. a new value head).
    """
    idx = SafetensorsIndex(model_dir)
    flat = traverse_util.flatten_dict(abstract)
    flat_shard = traverse_util.flatten_dict(shardings) if shardings is not None else {}
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out = {}
    for path, spec in flat.items():
        if path in skip:
            out[path] = None
            continue
        _check_shapes(idx, path, tuple(spec.shape), num_layers)
        sharding = flat_shard.get(path, default)
        out[path] = jax.make_array_from_callback(tuple(spec.shape), sharding,
                                                 _reader(idx, path, tuple(spec.shape), spec.dtype))
    return traverse_util.unflatten_dict(out)


def _fresh(a: jax.Array, dtype: Any) -> jax.Array:
    # an astype to the same dtype is the identity, and jit would forward the input buffer itself
    return a.astype(dtype) if dtype is not None and a.dtype != dtype else a + jnp.zeros((), a.dtype)


_export_layer_on_device = jax.jit(lambda x, i, dtype: _fresh(x[i], dtype), static_argnums=2)
_export_on_device = jax.jit(_fresh, static_argnums=1)


def _export_layer(x: Any, i: int, dtype: Any) -> Any:
    if isinstance(x, np.ndarray):  # parameters already on the host (a model saved as it was made): no program
        return x[i].astype(dtype or x.dtype)
    return _export_layer_on_device(x, i, dtype)


def _export(x: Any, dtype: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.astype(dtype or x.dtype)  # a copy, as on the device
    return _export_on_device(x, dtype)


def export_hf_arrays(params: Params, dtype: Any = None, group_bytes: int | None = None
                     ) -> Iterator[tuple[str, jax.Array]]:
    """(HF name, fresh JAX array) per tensor for a rollout engine: stacked layers sliced one layer at a
    time and cast on device. Never a buffer of the train state itself (the next update donates those).
    Parameters given as numpy arrays (already on the host) are sliced and cast there, into numpy arrays.

    Tensors are dispatched in groups of at most `group_bytes` (default: the largest single tensor) and
    each group is waited for once, so the consumer never waits per tensor while the extra memory held
    at any time stays within one group (<= the largest parameter)."""
    dtype = None if dtype is None else jnp.dtype(dtype)
    flat = traverse_util.flatten_dict(params)
    itemsize = lambda v: (dtype or v.dtype).itemsize
    sizes = {p: int(np.prod(v.shape[1:] if is_stacked(p) else v.shape)) * itemsize(v) for p, v in flat.items()}
    budget = group_bytes or max(sizes.values())
    group: list[tuple[str, jax.Array]] = []
    used = 0

    def jobs():
        for path, value in flat.items():
            if is_stacked(path):
                for i in range(value.shape[0]):
                    yield hf_name(path, i), sizes[path], (lambda v=value, i=i: _export_layer(v, i, dtype))
            else:
                yield hf_name(path), sizes[path], (lambda v=value: _export(v, dtype))

    for name, size, make in jobs():
        if group and used + size > budget:
            jax.block_until_ready([a for _, a in group])
            yield from group
            group, used = [], 0
        group.append((name, make()))
        used += size
    jax.block_until_ready([a for _, a in group])
    yield from group


class HFWeights:
    """The actor's parameters as a rollout engine receives them (`RolloutEngine.update_weights`).

    Iterating yields (HF name, fresh JAX array in `dtype`), as `export_hf_arrays`: engines that keep the
    arrays (transformers aliases them) take this. An engine that copies into its own storage (vLLM on
    GPU) may instead read `params` directly, without the intermediate buffers (`bridge.dlpack.hf_views`),
    and cast while it copies; those views are valid only until the train state's next update."""

    def __init__(self, params: Params, dtype: Any = None):
        self.params, self.dtype = params, dtype

    def __iter__(self) -> Iterator[tuple[str, jax.Array]]:
        return export_hf_arrays(self.params, self.dtype)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor (a stacked parameter's layer shape)."""
        out = {}
        for path, value in traverse_util.flatten_dict(self.params).items():
            for i, name in enumerate(iter_hf_names(path, value.shape[0] if is_stacked(path) else 1)):
                out[name] = tuple(value.shape[1:] if is_stacked(path) else value.shape)
        return out


def save_hf_checkpoint(params: Params, cfg: ModelConfig, out_dir: str | Path, *, head: str = "lm",
                       dtype: Any = jnp.float32, max_shard_bytes: int = 2 << 30) -> Path:
    """Write `params` as a Hugging Face checkpoint (safetensors shards + index + config.json) at `out_dir`, a
    directory of the run's own (a model it made: the embedded default, the warm start) or a new one; an existing
    `out_dir` is replaced as a whole (`jaxppo.export` is what writes into a user's directory).

    Written into a temporary sibling directory and renamed into place, so an interrupted save
    never leaves a half-written checkpoint under `out_dir`; the directory gets the permissions a plain `mkdir`
    would give it (the temporary one is private).
    """
    out_dir = Path(out_dir)
    # (numpy parameters, already on this host, are whole here)
    if jax.process_count() > 1 and not all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(params)):
        return _save_multiprocess(params, cfg, out_dir, head=head, dtype=dtype, max_shard_bytes=max_shard_bytes)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp", dir=out_dir.parent))
    try:
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name, x in export_hf_arrays(params, dtype):
            arr = np.asarray(jax.device_get(x))
            if size + arr.nbytes > max_shard_bytes and shards[-1]:
                shards.append({})
                size = 0
            shards[-1][name] = np.ascontiguousarray(arr)
            size += arr.nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        if len(shards) > 1:
            total = sum(a.nbytes for s in shards for a in s.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        arch = cfg.architecture if head == "lm" else cfg.architecture.replace("ForCausalLM", "ForTokenClassification")
        hf_cfg = cfg.to_hf_dict(arch, num_labels=None if head == "lm" else 1)  # "value" and "score": one label
        hf_cfg["torch_dtype"] = np.dtype(dtype).name
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        mask = _umask()
        os.chmod(tmp, 0o777 & ~mask)
        for f in tmp.iterdir():  # safetensors writes its files private (0600)
            os.chmod(f, 0o666 & ~mask)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _save_multiprocess(params: Params, cfg: ModelConfig, out_dir: Path, **kw) -> Path:
    """Every process gathers the global arrays (a collective); process 0 writes; all wait for it."""
    from jax.experimental import multihost_utils

    host = jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), params)
    if jax.process_index() == 0:
        save_hf_checkpoint(host, cfg, out_dir, **kw)
    multihost_utils.sync_global_devices(f"jaxppo-save-{out_dir}")
    return out_dir
