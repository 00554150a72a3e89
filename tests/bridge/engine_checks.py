"""Checks every rollout engine must pass (shared by the hf and vllm engine tests)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.models.hf_io import export_hf_arrays
from jaxppo.config import ActorConfig
from jaxppo.data import left_pad
from jaxppo.engine import ActorEngine
from jaxppo.rollout import Sampling, train_sequences
from jaxppo.sharding import make_mesh

MAX_TOKENS = 6


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in (5, 3, 7)]


def trainer_logprobs(module, params, prompt_ids, rollouts, temperature, truncation=None):
    """The trainer's log-probs of the rollouts: over the full vocabulary, or (with `truncation=(top_k, top_p)`)
    also under the truncated distribution the engine samples from."""
    ids, mask = left_pad([np.asarray(p) for p in prompt_ids], 0)
    batch = train_sequences(ids, mask, rollouts)
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    n = batch["input_ids"].shape[0]
    actor = ActorEngine(module, mesh, ActorConfig(log_prob_micro_batch_size_per_device=n, logprob_chunk_size=4),
                        rollouts.response_ids.shape[1], temperature=temperature)
    out = actor.logprobs(params, actor.shard_batch(batch), truncation=truncation)
    return np.asarray(out[0]) if truncation is None else (np.asarray(out[0]), np.asarray(out[2]))


def check_logprobs_match_trainer(engine, module, params, vocab, temperature=0.7, tol=1e-4):
    engine.update_weights(export_hf_arrays(params, jnp.float32))
    p = prompts(vocab)
    ro = engine.generate(p, Sampling(n=2, temperature=temperature, max_tokens=MAX_TOKENS, seed=1))
    assert ro.response_ids.shape == (6, MAX_TOKENS) and ro.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    ours = trainer_logprobs(module, params, p, ro, temperature)
    m = ro.response_mask > 0
    assert m.sum() > 6
    diff = np.abs(ours - ro.logprobs)[m]
    assert diff.max() <= tol, diff.max()
    return ro


def lora_case(model_dir, seed: int = 0):
    """A LoRA model of `model_dir` (rank 4, alpha 8, every projection) with trained-looking adapters (lora_B
    random, not zero): (module, the whole parameter tree, base, adapters, scale)."""
    from jaxppo.models import load_model
    from jaxppo.models.lora import LoraSpec, is_adapter, split

    spec = LoraSpec(4, 8.0)
    module, params, _ = load_model(model_dir, dtype=jnp.float32, lora=spec, rng=jax.random.PRNGKey(seed))
    adapters, base = split(params, is_adapter)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 64))
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: 0.05 * jax.random.normal(next(keys), x.shape) if path[-1].key == "lora_B" else x, adapters)
    from jaxppo.models.lora import merge

    return module, merge(adapters, base), base, adapters, spec.scale


def check_lora_push_matches_trainer(engine, model_dir, vocab, temperature=0.7, tol=1e-4):
    """LoRA: the engine receives the base with the adapters merged (LoRAWeights) and samples what the
    trainer's LoRA model (adapters applied beside the frozen base) gives the same log-probs."""
    from jaxppo.models.lora import LoRAWeights

    module, full, base, adapters, scale = lora_case(model_dir)
    engine.update_weights(LoRAWeights(base, adapters, scale, jnp.float32))
    p = prompts(vocab, seed=2)
    ro = engine.generate(p, Sampling(n=2, temperature=temperature, max_tokens=MAX_TOKENS, seed=3))
    ours = trainer_logprobs(module, full, p, ro, temperature)
    m = ro.response_mask > 0
    diff = np.abs(ours - ro.logprobs)[m]
    assert diff.max() <= tol, diff.max()
    # and the adapters matter: the base alone gives other log-probs
    engine.update_weights(export_hf_arrays(base, jnp.float32))
    plain = engine.generate(p, Sampling(n=2, temperature=temperature, max_tokens=MAX_TOKENS, seed=3))
    assert not np.array_equal(plain.logprobs, ro.logprobs)


def check_truncated_logprobs_match_trainer(engine, module, params, vocab, temperature=0.8, top_p=0.9, top_k=-1,
                                           tol=1e-4):
    """Under top-p / top-k the engine's log-probs describe the distribution it samples from (truncated and
    renormalised); the trainer's sampling log-probs describe the same one, its full-vocabulary log-probs (the
    policy it trains) do not."""
    engine.update_weights(export_hf_arrays(params, jnp.float32))
    p = prompts(vocab, seed=3)
    ro = engine.generate(p, Sampling(n=2, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=MAX_TOKENS,
                                     seed=2))
    full, sampling = trainer_logprobs(module, params, p, ro, temperature, truncation=(top_k, top_p))
    m = ro.response_mask > 0
    diff = np.abs(sampling - ro.logprobs)[m]
    assert diff.max() <= tol, diff.max()
    assert np.all(full[m] <= sampling[m] + 1e-6)  # renormalising over fewer tokens can only raise a probability
    assert np.abs(full - ro.logprobs)[m].max() > 10 * tol  # the full distribution is a different one


def check_update_changes_outputs(engine, params, vocab):
    p = prompts(vocab)
    s = Sampling(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    engine.update_weights(export_hf_arrays(params, jnp.float32))
    before = engine.generate(p, s)
    again = engine.generate(p, s)
    np.testing.assert_array_equal(before.logprobs, again.logprobs)
    scaled = jax.tree.map(lambda x: x * 1.5, params)
    engine.update_weights(export_hf_arrays(scaled, jnp.float32))
    after = engine.generate(p, s)
    assert np.abs(after.logprobs - before.logprobs).max() > 1e-3  # no stale weights / prefix cache
    engine.update_weights(export_hf_arrays(params, jnp.float32))


def check_seed_and_n(engine, vocab):
    p = prompts(vocab)
    s = Sampling(n=4, temperature=1.0, max_tokens=MAX_TOKENS, seed=123)
    a, b = engine.generate(p, s), engine.generate(p, s)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    c = engine.generate(p, Sampling(n=4, temperature=1.0, max_tokens=MAX_TOKENS, seed=124))
    assert (a.response_ids != c.response_ids).any()
    for prompt in range(3):  # n distinct samples per prompt
        rows = {tuple(r) for r in a.response_ids[a.prompt_index == prompt].tolist()}
        assert len(rows) == 4
    # log-probs not asked for: the same samples, NaN log-probs
    none = engine.generate(p, dataclasses.replace(s, logprobs=False))
    np.testing.assert_array_equal(none.response_ids, a.response_ids)
    assert np.isnan(none.logprobs).all() and np.isfinite(a.logprobs).all()


def check_eos_stops(engine, vocab):
    p = prompts(vocab)
    s = Sampling(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    free = engine.generate(p, s)
    assert free.finish_reasons == ["length"] * 3 and (free.lengths == MAX_TOKENS).all()
    stop_id = int(free.response_ids[0, 2])
    stopped = engine.generate(p, Sampling(n=1, temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=(stop_id,)))
    first = int(np.argmax(free.response_ids[0] == stop_id))
    assert stopped.finish_reasons[0] == "stop" and stopped.lengths[0] == first + 1
    assert stopped.response_mask[0, : first + 1].all() and not stopped.response_mask[0, first + 1:].any()
    assert stopped.response_ids[0, first] == stop_id
