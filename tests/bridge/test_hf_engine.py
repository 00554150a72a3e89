"""The transformers engine: parity with the trainer's log-probs, zero-copy weights, sampling semantics."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

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
    torch_params = dict(engine.model.named_parameters())
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"):
        assert engine.param_pointer(name) == jax_pointer(arrays[name]), name
        # the same memory, not an equal copy: a write through torch is seen through JAX's buffer
        before = np.asarray(arrays[name]).copy()
        with torch.no_grad():
            torch_params[name].data.add_(1.0)
        seen = np.asarray(arrays[name]).copy()
        with torch.no_grad():
            torch_params[name].data.sub_(1.0)
        np.testing.assert_allclose(seen, before + 1.0, rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_p,top_k", [(0.9, -1), (1.0, 5), (0.8, 20)])
def test_truncated_sampling_logprobs_match_trainer(setup, top_p, top_k):
    engine, module, params, cfg = setup
    checks.check_truncated_logprobs_match_trainer(engine, module, params, cfg.vocab_size, top_p=top_p, top_k=top_k)


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


def test_lora_merged_push_matches_trainer(setup, tiny_qwen):
    engine, module, params, cfg = setup
    checks.check_lora_push_matches_trainer(engine, tiny_qwen, cfg.vocab_size)
