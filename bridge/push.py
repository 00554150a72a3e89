"""Direct weight push: Hugging Face-named tensors copied straight into an engine's own parameters.

vLLM's `load_weights` walks the checkpoint tensor by tensor through Python weight loaders (~0.25 ms
each, whatever the size), and the trainer had to make a bf16 copy of every tensor first. `DirectCopy`
instead maps each HF tensor once to its destination rows in the engine's parameters (vLLM fuses
q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, in that order, along the output dimension) and
then pushes them one parameter at a time: the fp32 -> bf16 cast happens inside the copy, reading the
train state's buffers through DLPack views, so nothing is allocated. On a GPU the copy is one Triton
launch per parameter (`bridge/cast_copy.py`, all its layers at once); elsewhere, or for other dtypes,
one batched `torch._foreach_copy_`.

The plan is built for one tensor-parallel rank holding whole parameters; any other layout (a shard,
a quantised or repacked weight, a name it does not know) is a `PlanError` and the caller falls back to
the engine's own loader.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import jax
import torch
from flax import traverse_util

from bridge import cast_copy
from bridge.dlpack import _whole_here, hf_views, layer_views
from jaxppo.models.hf_io import hf_name, is_stacked

# HF projection -> (fused parameter, position of the part along the output dimension)
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class PlanError(ValueError):
    pass


def destination(hf_name: str) -> tuple[str, int]:
    """HF tensor name -> (engine parameter name, part index)."""
    parts = hf_name.split(".")
    for j, p in enumerate(parts):
        if p in FUSED:
            fused, k = FUSED[p]
            return ".".join(parts[:j] + [fused] + parts[j + 1:]), k
    return hf_name, 0


class DirectCopy:
    """Destination views for every HF tensor in `shapes`, inside `params` (engine name -> tensor)."""

    def __init__(self, params: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]):
        groups: dict[str, list[tuple[int, str, tuple[int, ...]]]] = defaultdict(list)
        for name, shape in shapes.items():
            target, k = destination(name)
            if target not in params:
                raise PlanError(f"{name}: the engine has no parameter {target!r}")
            groups[target].append((k, name, tuple(shape)))
        self.views: dict[str, torch.Tensor] = {}
        for target, parts in groups.items():
            dst = params[target].data
            parts.sort()
            offset = 0
            for _, name, shape in parts:
                if tuple(dst.shape[1:]) != shape[1:] or offset + shape[0] > dst.shape[0]:
                    raise PlanError(f"{name} {shape} does not fit {target} {tuple(dst.shape)} at row {offset}")
                self.views[name] = dst.narrow(0, offset, shape[0])
                offset += shape[0]
            fused = len(parts) > 1 or parts[0][1] != target
            if fused and offset != dst.shape[0]:  # a tensor-parallel shard, or another layout
                raise PlanError(f"{target}: its parts fill {offset} of {dst.shape[0]} rows")
        missing = sorted(set(params) - set(groups))
        if missing:
            raise PlanError(f"no HF tensor fills the engine's {missing[:3]}")
        self._key: tuple | None = None
        self._dsts: list[torch.Tensor] = []
        self._tables: dict[int, cast_copy.PointerTable] = defaultdict(cast_copy.PointerTable)
        self.kernel = "auto"  # auto: the Triton cast-copy where it applies | foreach: torch._foreach_copy_ only

    def _order(self, flat: dict) -> None:
        """The destination of each HF tensor the parameter paths expand to, in tree order (`_dsts`,
        built once per tree structure)."""
        key = tuple((path, v.shape[0] if is_stacked(path) else None) for path, v in flat.items())
        if self._key != key:
            names = [hf_name(p, i) for p, n in key for i in (range(n) if n is not None else (None,))]
            missing = sorted(set(self.views) - set(names))
            if missing or len(names) != len(self.views):
                raise PlanError(f"the parameters do not match the plan (missing {missing[:3]})")
            self._key, self._dsts = key, [self.views[n] for n in names]

    def _wholes(self, params: Any) -> tuple[dict, list] | None:
        flat = traverse_util.flatten_dict(params)
        self._order(flat)
        wholes = [_whole_here(v) for v in flat.values()]
        if any(w is None for w in wholes):
            return None
        jax.block_until_ready(wholes)  # JAX dispatch is asynchronous
        return flat, wholes

    def sources(self, params: Any) -> list[torch.Tensor] | None:
        """Torch views of every HF tensor, in plan order, straight from the parameters' buffers (a
        stacked parameter: one DLPack view, unbound into its layers); None if a parameter is sharded
        over several devices (then `copy(hf_views(...))` gathers it layer by layer)."""
        found = self._wholes(params)
        if found is None:
            return None
        return [v for path, w in zip(*found) for v in layer_views(path, w)]

    def push(self, params: Any) -> int:
        """Copy a parameter tree (Flax, HF layout) into the engine's parameters; returns the tensor count.
        One batched copy per parameter, issued as soon as its views exist, so the device copies while
        the host prepares the next. Returns once the copies are enqueued: synchronise before the
        source buffers can be donated."""
        found = self._wholes(params)
        if found is None:
            return self.copy(hf_views(params))
        done = 0
        for path, w in zip(*found):
            whole = torch.from_dlpack(w)
            k = whole.shape[0] if is_stacked(path) else 1
            dsts = self._dsts[done:done + k]
            table = self._tables[done].get(whole, dsts) if self.kernel == "auto" else None
            if table is not None:
                cast_copy.cast_copy(whole, dsts, table)
            else:
                torch._foreach_copy_(dsts, list(whole.unbind(0)) if is_stacked(path) else [whole])
            done += k
        return done

    def push_items(self, structure: Any, items: Iterable[tuple[tuple[str, ...], int | None, Any]]) -> int:
        """Copy parameters produced one at a time into the engine's parameters: (path, layer, array) with `layer`
        None for a whole parameter of `structure` (all its layers) or i for layer i of a stacked one (LoRA's merged
        weights, made one layer at a time). Each copy is waited for before the next array is made, so only one
        produced array exists at a time; the copy casts to the engine's dtype. Returns the tensor count."""
        flat = traverse_util.flatten_dict(structure)
        self._order(flat)
        first, k = {}, 0
        for path, v in flat.items():
            first[path] = k
            k += v.shape[0] if is_stacked(path) else 1
        done = 0
        for path, layer, array in items:
            w = _whole_here(array)
            if w is None:
                raise PlanError(f"{path}: a pushed array sharded over several devices")
            jax.block_until_ready(w)
            src = torch.from_dlpack(w)
            if layer is None and is_stacked(path):
                dsts, srcs = self._dsts[first[path]:first[path] + src.shape[0]], list(src.unbind(0))
            else:
                dsts, srcs = [self._dsts[first[path] + (layer or 0)]], [src]
            torch._foreach_copy_(dsts, srcs)
            _wait(src)
            done += len(dsts)
            del w, src, srcs, array  # let the produced array go before the next is made
        return done

    def copy(self, named: Iterable[tuple[str, torch.Tensor, bool]]) -> int:
        """Copy (name, source, borrowed) into place with casting; returns the number of tensors.
        Borrowed sources are copied together at the end; a fresh one (a gathered shard) at once, and
        waited for before it is dropped. Returns after the copies are enqueued on torch's stream."""
        dsts, srcs, seen = [], [], set()
        for name, src, borrowed in named:
            if name not in self.views:
                raise PlanError(f"{name}: not in the plan")
            seen.add(name)
            if borrowed:
                dsts.append(self.views[name])
                srcs.append(src)
            else:
                self.views[name].copy_(src)
                _wait(src)
        if len(seen) != len(self.views):
            raise PlanError(f"tensors missing from the push: {sorted(set(self.views) - seen)[:3]}")
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return len(seen)


def _wait(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()
