"""Flax Qwen2 / Qwen3 / Llama models, their critic, and Hugging Face checkpoint I/O."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxppo.errors import CheckpointError
from jaxppo.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, config_from_hf_dict, load_config
from jaxppo.models.hf_io import SafetensorsIndex, export_hf_arrays, load_params, save_hf_checkpoint
from jaxppo.models.lora import LoraSpec, init_adapters, is_adapter, merge, split
from jaxppo.models.transformer import REMAT_POLICIES, CausalLM, ValueModel, positions_from_mask

__all__ = [
    "SUPPORTED_ARCHITECTURES", "ModelConfig", "CausalLM", "ValueModel", "REMAT_POLICIES",
    "build_model", "abstract_params", "init_params", "load_model", "load_config", "config_from_hf_dict",
    "save_hf_checkpoint", "export_hf_arrays", "positions_from_mask",
]

SCORE_PATHS = (("score", "weight"), ("score", "bias"))


def build_model(cfg: ModelConfig, head: str = "lm", *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                remat: str = "none", attention_impl: str | None = None, score_bias: bool = True,
                attention_window: int | None = None, scan_unroll: int = 1, lora: LoraSpec = LoraSpec(),
                prevent_cse: bool = False) -> nn.Module:
    """The Flax module for `cfg`: `CausalLM` for head "lm", `ValueModel` for head "value".
    `attention_window`: the longest sequence the model will see; rows longer than that (packed) attend
    only that far back, which lets cuDNN skip blocks when attention goes through a mask
    (`attention_impl="cudnn_mask"`; `"cudnn"` attends within each sequence without one)."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat {remat!r} unknown; known: {sorted(REMAT_POLICIES)}")
    kw = dict(dtype=dtype, param_dtype=param_dtype, remat=remat, attention_impl=attention_impl,
              attention_window=attention_window, scan_unroll=scan_unroll, lora=lora, prevent_cse=prevent_cse)
    if head == "lm":
        return CausalLM(cfg, **kw)
    if head == "value":
        return ValueModel(cfg, score_bias=score_bias, **kw)
    raise ValueError(f"head {head!r} unknown; known: ['lm', 'value']")


def _dummy_inputs():
    ids = jnp.zeros((1, 2), jnp.int32)
    return ids, ids, jnp.ones((1, 2), jnp.int32)


def _init(module: nn.Module, rng: jax.Array) -> Any:
    # the same parameter tree from the rolled layer loop and XLA's attention: initialising runs the forward
    # pass once on a dummy batch, and compiling it with every layer unrolled (scan_unroll=0) took a minute at 0.5B
    module = module.clone(scan_unroll=1, attention_impl=None, prevent_cse=False)
    method = module.forward_logits if isinstance(module, CausalLM) else None  # creates the LM head too
    return module.init(rng, *_dummy_inputs(), method=method)["params"]


# abstract_params of each module (by the fields its parameters depend on): a start asks it of the same actor,
# critic and reference modules five times, each an eval_shape that traces the whole forward pass (0.25-0.35 s
# each for a 2-layer model on a 2-core CPU, 2026-12-06)
_ABSTRACT: dict[tuple, Any] = {}


def abstract_params(module: nn.Module) -> Any:
    """Parameter tree of `nn.Partitioned` ShapeDtypeStructs (shapes + logical axis names), no memory used."""
    # _init's clone sets scan_unroll, attention_impl and prevent_cse: they do not change the parameters
    key = (type(module), *((f.name, getattr(module, f.name)) for f in dataclasses.fields(module)
                           if f.name not in ("parent", "name", "scan_unroll", "attention_impl", "prevent_cse")))
    if key not in _ABSTRACT:
        _ABSTRACT[key] = jax.eval_shape(lambda: _init(module, jax.random.PRNGKey(0)))
    return jax.tree.map(lambda x: x, _ABSTRACT[key])  # a tree of its own: the caller may edit its dicts


def init_params(module: nn.Module, rng: jax.Array, shardings: Any = None) -> Any:
    """Random parameters, created directly in `shardings` (a tree of Shardings; None: default device)."""
    init = lambda r: nn.unbox(_init(module, r))
    if shardings is None:
        return jax.jit(init)(rng)
    return jax.jit(init, out_shardings=shardings)(rng)


def load_model(model_dir: str | Path, head: str = "lm", *, mesh: jax.sharding.Mesh | None = None,
               rng: jax.Array | None = None, random_init: bool = False, **build_kw) -> tuple[nn.Module, Any, ModelConfig]:
    """Build the module for a HF checkpoint and read its weights into their sharding.

    head "value": a token-classification checkpoint (`score.weight`, num_labels=1, e.g. a verl critic)
    loads its head; a causal-LM checkpoint gets a new head (HF's init: normal(0.02) weight, zero bias).
    `lora=LoraSpec(rank > 0, ...)`: LoRA adapters on the chosen projections, initialised as PEFT does (A
    kaiming-uniform, B zero: the model computes exactly the checkpoint's function until they are trained).
    """
    from jaxppo import sharding as shd

    cfg, kind = load_config(model_dir)
    if random_init:  # the architecture of config.json, random weights created directly in their sharding
        module = build_model(cfg, head, **build_kw)
        shardings = shd.param_shardings(abstract_params(module), mesh) if mesh is not None else None
        return module, init_params(module, rng if rng is not None else jax.random.PRNGKey(0), shardings), cfg
    if head == "lm" and kind != "lm":
        raise CheckpointError(f"{model_dir}: a token-classification checkpoint cannot be used as a causal LM")
    from_critic = head == "value" and kind == "score"
    if from_critic:
        index = SafetensorsIndex(model_dir)
        build_kw.setdefault("score_bias", "score.bias" in index.files)
        if index.shape("score.weight")[0] != 1:
            raise CheckpointError(f"{model_dir}: tensor 'score.weight' has {index.shape('score.weight')[0]} labels; "
                                  "a value head needs num_labels=1")
    module = build_model(cfg, head, **build_kw)
    boxed = abstract_params(module)
    shardings = shd.param_shardings(boxed, mesh) if mesh is not None else None
    abstract = nn.unbox(boxed)
    skip = () if (head == "lm" or from_critic) else SCORE_PATHS
    adapters = tuple(p for p in traverse_util.flatten_dict(abstract) if is_adapter(p))
    params = load_params(model_dir, abstract, cfg.num_hidden_layers, shardings, skip=skip + adapters)
    if adapters:
        lora_init = init_adapters(split(abstract, is_adapter)[0], rng if rng is not None else jax.random.PRNGKey(0),
                                  split(shardings, is_adapter)[0] if shardings is not None else None)
        params = merge(lora_init, split(params, lambda p: not is_adapter(p))[0])
    if skip:  # a new value head, HF's init: weight ~ normal(0, 0.02), bias 0
        flat = traverse_util.flatten_dict(params)
        flat_abs = traverse_util.flatten_dict(abstract)
        flat_shard = traverse_util.flatten_dict(shardings) if shardings is not None else {}
        key = rng if rng is not None else jax.random.PRNGKey(0)
        for path in SCORE_PATHS:
            if path in flat:
                spec = flat_abs[path]
                value = (0.02 * jax.random.normal(key, spec.shape, jnp.float32) if path[-1] == "weight"
                         else jnp.zeros(spec.shape, jnp.float32)).astype(spec.dtype)
                flat[path] = jax.device_put(value, flat_shard[path]) if path in flat_shard else value
        params = traverse_util.unflatten_dict(flat)
    return module, params, cfg
