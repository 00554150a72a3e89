"""Direct weight push (bridge.push.DirectCopy over bridge.dlpack.hf_views) against an independent layout.

vLLM on CPU repacks its linear weights after loading, so the direct path runs on GPU only; here the
destination is built by hand in vLLM's documented layout (q/k/v and gate/up concatenated along the
output rows, in that order) and the result is compared with the concatenation of the exported tensors.
On the H200, scripts/bench_sync.py checks it bit for bit against vLLM's own load_weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.dlpack import hf_views, jax_pointer
from bridge.push import DirectCopy, PlanError
from jaxppo.models import load_model
from jaxppo.models.hf_io import HFWeights, export_hf_arrays
from jaxppo.sharding import make_mesh

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_reference(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """vLLM's parameter layout for one tensor-parallel rank, by concatenation."""
    out, used = {}, set()
    for name in arrays:
        for fused, parts in FUSED.items():
            for p in parts:
                if f".{p}." in name:
                    target = name.replace(p, fused)
                    if target not in out:
                        names = [name.replace(p, q) for q in parts]
                        out[target] = np.concatenate([arrays[n] for n in names])
                        used.update(names)
    out.update({n: a for n, a in arrays.items() if n not in used})
    return out


def destination(ref: dict[str, np.ndarray], dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    return {n: torch.full(a.shape, float("nan"), dtype=dtype) for n, a in ref.items()}


def check(params, ref_params):
    # JAX's own bf16 rounding as the reference for torch's cast inside the copy
    arrays = {n: np.asarray(a.astype(jnp.float32)) for n, a in export_hf_arrays(ref_params, jnp.bfloat16)}
    ref = fused_reference(arrays)
    assert "model.layers.1.self_attn.qkv_proj.bias" in ref and "model.layers.0.mlp.gate_up_proj.weight" in ref
    dst = destination(ref)
    plan = DirectCopy(dst, HFWeights(params).shapes())
    assert plan.push(params) == len(arrays)  # borrowed views in one batch, or gathered layer by layer
    for name, want in ref.items():  # every row written (no NaN left), bit-equal to JAX's bf16 cast
        np.testing.assert_array_equal(dst[name].float().numpy(), want, err_msg=name)


def test_direct_copy_matches_fused_layout_zero_copy_sources(tiny_qwen):
    _, params, _ = load_model(tiny_qwen)
    views = list(hf_views(params))
    assert all(borrowed for _, _, borrowed in views)
    q = params["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    layer_bytes = int(np.prod(q.shape[1:])) * q.dtype.itemsize
    by_name = {n: t for n, t, _ in views}
    for i in range(q.shape[0]):  # a layer is a view into the train state's own stacked buffer
        assert by_name[f"model.layers.{i}.self_attn.q_proj.weight"].data_ptr() == jax_pointer(q) + i * layer_bytes
    assert by_name["model.embed_tokens.weight"].data_ptr() == jax_pointer(params["model"]["embed_tokens"]["weight"])
    check(params, params)
    ref = fused_reference({n: np.asarray(a) for n, a in export_hf_arrays(params, jnp.float32)})
    plan = DirectCopy(destination(ref), HFWeights(params).shapes())
    srcs = plan.sources(params)  # the batched push reads the same buffers, no intermediate copies
    assert sorted(t.data_ptr() for t in srcs) == sorted(t.data_ptr() for t in by_name.values())


def test_direct_copy_from_sharded_parameters(tiny_qwen):
    _, params, _ = load_model(tiny_qwen, mesh=make_mesh({"fsdp": 4, "tensor": 2}))
    _, ref, _ = load_model(tiny_qwen)
    assert not all(borrowed for _, _, borrowed in hf_views(params))  # sharded ones are gathered per layer
    plan = DirectCopy(destination(fused_reference({n: np.asarray(a) for n, a in export_hf_arrays(ref)})),
                      HFWeights(params).shapes())
    assert plan.sources(params) is None
    check(params, ref)


def test_plan_refuses_layouts_it_does_not_know(tiny_qwen):
    _, params, _ = load_model(tiny_qwen)
    shapes = HFWeights(params).shapes()
    ref = fused_reference({n: np.asarray(a) for n, a in export_hf_arrays(params, jnp.float32)})
    shard = destination(ref)  # a tensor-parallel rank: half of the fused rows
    name = "model.layers.0.self_attn.qkv_proj.weight"
    shard[name] = shard[name][: shard[name].shape[0] // 2]
    with pytest.raises(PlanError, match="qkv_proj"):
        DirectCopy(shard, shapes)
    extra = destination(ref) | {"model.layers.0.mlp.experts": torch.zeros(2)}
    with pytest.raises(PlanError, match="experts"):
        DirectCopy(extra, shapes)
    renamed = {n.replace("gate_up_proj", "w13"): t for n, t in destination(ref).items()}
    with pytest.raises(PlanError, match="gate_up_proj"):
        DirectCopy(renamed, shapes)
    plan = DirectCopy(destination(ref), shapes)
    with pytest.raises(PlanError, match="missing"):
        plan.copy(v for v in hf_views(params) if "down_proj" not in v[0])


def test_direct_copy_qwen3_layout(tiny_qwen3):
    """Qwen3: the per-head q / k norms are their own parameters in vLLM too; no q/k/v bias."""
    _, params, _ = load_model(tiny_qwen3)
    arrays = {n: np.asarray(a.astype(jnp.float32)) for n, a in export_hf_arrays(params, jnp.bfloat16)}
    ref = fused_reference(arrays)
    assert "model.layers.1.self_attn.q_norm.weight" in ref and "model.layers.0.self_attn.qkv_proj.weight" in ref
    assert not any(n.endswith("qkv_proj.bias") for n in ref)
    dst = destination(ref)
    assert DirectCopy(dst, HFWeights(params).shapes()).push(params) == len(arrays)
    for name, want in ref.items():
        np.testing.assert_array_equal(dst[name].float().numpy(), want, err_msg=name)
