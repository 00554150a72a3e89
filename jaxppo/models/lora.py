"""LoRA: low-rank adapters on the decoder's projections, trained while the base weights stay frozen.

A targeted projection computes y = x W^T (+ b) + (alpha / r) (x A^T) B^T with A [r, in] and B [out, r] (PEFT's
layout and names: `lora_A`, `lora_B`). A starts as PEFT's kaiming-uniform, B at zero, so step 0 is the base
model exactly. The adapters are float32 and trained with AdamW; the base weights are stored in the compute
dtype and get neither gradients nor optimizer state. The reference policy is the base (no second copy of the
weights): the module without adapters on the frozen weights (`ActorEngine.ref_logprobs`). The rollout engine
receives merged weights W + (alpha / r) B A, one parameter at a time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from flax import traverse_util

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_KEYS = ("lora_A", "lora_B")
Params = Any


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int = 0  # 0: no adapters
    alpha: float = 16.0
    targets: tuple[str, ...] = PROJECTIONS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def on(self, name: str) -> int:
        """The rank for the projection `name` (0: none)."""
        return self.rank if self.rank and name in self.targets else 0


def parse_targets(target_modules: str) -> tuple[str, ...]:
    """`all-linear` (every projection of the decoder layers; not the vocabulary head, as PEFT does) or a
    comma list of projection names."""
    names = tuple(n.strip() for n in target_modules.split(",") if n.strip())
    if names == ("all-linear",):
        return PROJECTIONS
    unknown = [n for n in names if n not in PROJECTIONS]
    if unknown or not names:
        raise ValueError(f"target_modules {target_modules!r}: unknown {unknown}; known: ['all-linear', "
                         f"{', '.join(repr(p) for p in PROJECTIONS)}]")
    return names


def spec_from(cfg: Any) -> LoraSpec:
    """The LoraSpec of an ActorConfig / CriticConfig (`lora_rank`, `lora_alpha`, `target_modules`)."""
    if cfg.lora_rank <= 0:
        return LoraSpec()
    return LoraSpec(cfg.lora_rank, float(cfg.lora_alpha), parse_targets(cfg.target_modules))


def projection_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of one decoder layer of a ModelConfig."""
    d, f, h, kv, hd = (model.hidden_size, model.intermediate_size, model.num_attention_heads,
                       model.num_key_value_heads, model.head_dim)
    return {"q_proj": (h * hd, d), "k_proj": (kv * hd, d), "v_proj": (kv * hd, d), "o_proj": (d, h * hd),
            "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}


def adapter_params(model: Any, spec: LoraSpec) -> int:
    """How many adapter parameters `spec` puts on a model of ModelConfig `model`: r (in + out) per target."""
    shapes = projection_shapes(model)
    return model.num_hidden_layers * sum(spec.on(n) * sum(shapes[n]) for n in shapes)


def kaiming_a(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """PEFT's init of lora_A: kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(shape[-1])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def is_adapter(path: tuple[str, ...]) -> bool:
    return path[-1] in ADAPTER_KEYS


def split(params: Params, trainable: Callable[[tuple[str, ...]], bool]) -> tuple[Params, Params]:
    """(the leaves `trainable` selects, the rest), both nested like `params`."""
    flat = traverse_util.flatten_dict(params)
    a = {p: v for p, v in flat.items() if trainable(p)}
    b = {p: v for p, v in flat.items() if not trainable(p)}
    return traverse_util.unflatten_dict(a), traverse_util.unflatten_dict(b)


def merge(a: Params, b: Params) -> Params:
    """The union of two disjoint parameter trees."""
    flat = dict(traverse_util.flatten_dict(b))
    flat.update(traverse_util.flatten_dict(a))
    return traverse_util.unflatten_dict(flat)


def adapter_pairs(params: Params) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """(path of the adapted weight, lora_A, lora_B) for every adapted projection in `params`."""
    flat = traverse_util.flatten_dict(params)
    for path, a in flat.items():
        if path[-1] == "lora_A":
            yield path[:-1] + ("weight",), a, flat[path[:-1] + ("lora_B",)]


def _merged(w: jax.Array, a: jax.Array, b: jax.Array, scale: float, dtype: Any) -> jax.Array:
    """W + scale B A in float32 (float64 adapters: float64), cast to `dtype` (stacked layers: [L, out, in],
    [L, r, in], [L, out, r])."""
    f = jnp.promote_types(a.dtype, jnp.float32)
    delta = jnp.einsum("...or,...ri->...oi", b.astype(f), a.astype(f))
    return (w.astype(f) + scale * delta).astype(dtype)


merged_weight = jax.jit(_merged, static_argnums=(3, 4))
# one layer i of stacked [L, ...] weights, sliced inside the program: only the merged layer is allocated
merged_layer = jax.jit(lambda w, a, b, i, scale, dtype: _merged(w[i], a[i], b[i], scale, dtype), static_argnums=(4, 5))


def merged_params(base: Params, adapters: Params, scale: float, dtype: Any = None) -> Params:
    """The merged model as one tree (export; the rollout push merges one parameter at a time instead)."""
    flat = dict(traverse_util.flatten_dict(base))
    for path, a, b in adapter_pairs(adapters):
        flat[path] = merged_weight(flat[path], a, b, scale, jnp.dtype(dtype or flat[path].dtype))
    return traverse_util.unflatten_dict(flat)


def zeros_like_adapters(adapters: Params) -> Params:
    """Adapters that change nothing: the reference policy under LoRA is the base model."""
    return jax.tree.map(jnp.zeros_like, adapters)


def init_adapters(abstract: Params, rng: jax.Array, shardings: Any = None) -> Params:
    """lora_A kaiming-uniform, lora_B zero, for the adapter leaves of an abstract tree, in their shardings."""
    flat = traverse_util.flatten_dict(abstract)
    flat_shard = traverse_util.flatten_dict(shardings) if shardings is not None else {}
    out = {}
    for i, (path, spec) in enumerate(sorted(flat.items())):
        if not is_adapter(path):
            continue
        key = jax.random.fold_in(rng, i)
        value = kaiming_a(key, spec.shape) if path[-1] == "lora_A" else jnp.zeros(spec.shape, jnp.float32)
        value = value.astype(spec.dtype)
        out[path] = jax.device_put(value, flat_shard[path]) if path in flat_shard else value
    return traverse_util.unflatten_dict(out)


class LoRAWeights:
    """The actor's weights as a rollout engine receives them under LoRA: the frozen base with the adapters
    merged in, W + (alpha / r) B A (in float32, cast to the push dtype), computed on the device one layer of one
    projection at a time, so beside the base at most one merged layer exists at once.

    `items()` yields (parameter path, layer, array): the base's own arrays whole (layer None; the consumer's
    copy casts them) and each adapted projection's merged layers one by one (`bridge.push.DirectCopy.push_items`
    writes each into vLLM's parameters and lets it go before the next). Iterating yields (HF name, array) per
    tensor in the push dtype, as `jaxppo.models.hf_io.HFWeights` does (engines that keep the arrays, vLLM's
    `load_weights`)."""

    def __init__(self, base: Params, adapters: Params, scale: float, dtype: Any = None):
        self.params, self.adapters, self.scale = base, adapters, scale
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self._pairs = {path: (a, b) for path, a, b in adapter_pairs(adapters)}

    def items(self) -> Iterator[tuple[tuple[str, ...], int | None, jax.Array]]:
        from jaxppo.models.hf_io import is_stacked

        for path, value in traverse_util.flatten_dict(self.params).items():
            if path not in self._pairs:
                yield path, None, value
                continue
            a, b = self._pairs[path]
            dtype = self.dtype or value.dtype
            if is_stacked(path):
                for i in range(value.shape[0]):
                    yield path, i, merged_layer(value, a, b, i, self.scale, dtype)
            else:
                yield path, None, merged_weight(value, a, b, self.scale, dtype)

    def __iter__(self):
        from jaxppo.models.hf_io import export_hf_arrays, hf_name

        for path, layer, value in self.items():
            if layer is not None:
                yield hf_name(path, layer), value
            else:
                yield from export_hf_arrays(traverse_util.unflatten_dict({path: value}), self.dtype)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        from jaxppo.models.hf_io import HFWeights

        return HFWeights(self.params, self.dtype).shapes()


__all__ = ["LoRAWeights", "LoraSpec", "PROJECTIONS", "parse_targets", "spec_from", "is_adapter", "split", "merge", "adapter_pairs",
           "merged_weight", "merged_layer", "merged_params", "zeros_like_adapters", "init_adapters", "kaiming_a",
           "adapter_params", "projection_shapes"]
