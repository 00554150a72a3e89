"""`abstract_params` is kept per module (a start asks it of the same modules several times): a module whose
parameters differ gets its own tree, and a caller editing the tree it got does not edit the kept one."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxppo.models import build_model, init_params
from jaxppo.models import abstract_params
from jaxppo.models.config import ModelConfig
from jaxppo.models.lora import LoraSpec

CFG = ModelConfig("qwen2", 96, 32, 64, 2, 4, 2, 8, 1e-6, 1e4, False, True)


def shapes(tree):
    return {k: (v.shape, v.dtype) for k, v in traverse_util.flatten_dict(nn.unbox(tree)).items()}


def test_each_module_gets_the_parameters_it_creates():
    variants = {
        "lm": build_model(CFG),
        "value": build_model(CFG, "value"),
        "value_nobias": build_model(CFG, "value", score_bias=False),
        "bf16": build_model(CFG, param_dtype=jnp.bfloat16),
        "lora": build_model(CFG, lora=LoraSpec(4, 8.0)),
        "wider": build_model(ModelConfig("qwen2", 96, 48, 64, 2, 4, 2, 12, 1e-6, 1e4, False, True)),
    }
    for name, module in [*variants.items(), *variants.items()]:  # the second time from what was kept
        real = jax.eval_shape(lambda m=module: init_params(m, jax.random.PRNGKey(0)))
        assert shapes(abstract_params(module)) == shapes(real), name
    # the options _init overrides do not change the parameters: one tree for them
    assert shapes(abstract_params(build_model(CFG, scan_unroll=0))) == shapes(abstract_params(variants["lm"]))


def test_a_caller_editing_its_tree_leaves_the_kept_one_alone():
    module = build_model(CFG)
    first = abstract_params(module)
    first["model"].pop("norm")
    assert "norm" in abstract_params(module)["model"]
    assert all(isinstance(x, nn.Partitioned) for x in jax.tree.leaves(
        abstract_params(module), is_leaf=lambda x: isinstance(x, nn.Partitioned)))
