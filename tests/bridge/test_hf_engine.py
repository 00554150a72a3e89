"""The transformers engine: parity with the trainer's log-probs, zero-copy weights, sampling semantics."""

import jax.numpy as jnp
import pytest

from bridge.dlpack import jax_pointer
from jaxppo.models.hf_io import export_hf_arrays
from bridge.engines import make_engine
from jaxppo.models import load_model
from tests.bridge import engine_checks as checks


@pytest.fixture(scope="module")
def setup(tiny_qwen):
    module, params, cfg = load_model(tiny_qwen, dtype=jnp.float32)
    engine = make_engine("hf", model_dir=tiny_qwen, dtype="float32", pad_token_id=0, eos_token_ids=())
    return engine, module, params, cfg


def test_logprobs_match_trainer(setup):
    engine, module, params, cfg = setup
    checks.check_logprobs_match_trainer(engine, module, params, cfg.vocab_size)


def test_weights_are_zero_copy(setup):
    engine, module, params, cfg = setup
    arrays = dict(export_hf_arrays(params, jnp.float32))
    engine.update_weights(arrays.items())
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"):
        assert engine.param_pointer(name) == jax_pointer(arrays[name]), name
        assert jax_pointer(arrays[name]) != jax_pointer(params["model"]["norm"]["weight"])


def test_update_changes_outputs(setup):
    engine, module, params, cfg = setup
    checks.check_update_changes_outputs(engine, params, cfg.vocab_size)


def test_seed_and_n(setup):
    engine, module, params, cfg = setup
    engine.update_weights(export_hf_arrays(params, jnp.float32))
    checks.check_seed_and_n(engine, cfg.vocab_size)


def test_eos_stops_and_mask(setup):
    engine, module, params, cfg = setup
    engine.update_weights(export_hf_arrays(params, jnp.float32))
    checks.check_eos_stops(engine, cfg.vocab_size)


def test_unknown_engine_lists_known():
    with pytest.raises(KeyError, match=r"unknown rollout engine 'sglang'.*'hf', 'vllm'"):
        make_engine("sglang")
