"""The rollout engine protocol: how the trainer talks to a generation engine without importing torch.

Engines live in `bridge.engines` (transformers, in-process vLLM). The trainer hands them weights as an
iterator of (Hugging Face name, jax.Array) consumed during `update_weights` (the engine converts each
array through DLPack), and gets back `Rollouts` as numpy arrays.

Log-prob semantics (all engines, as vLLM's `processed_logprobs`): the log-prob of the sampled token under the
distribution it was sampled from: softmax(logits / temperature) restricted to the top-k tokens and then to
the top-p nucleus, renormalised (with neither, the full vocabulary at the temperature). The policy the trainer
optimises is the full softmax(logits / temperature) (verl's and TRL's convention); for the rollout-vs-trainer
mismatch metrics it also computes the truncated log-probs (`jaxppo.engine.truncated_logprobs`), so both
sides describe the same distribution. Truncated importance sampling (`actor.tis_threshold`) corrects from the
engine's sampling distribution to the trainer's full policy, which is what it is for.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Protocol, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Sampling:
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_tokens: int = 256  # response length cap
    seed: int | None = None  # same seed -> same samples (one generator for the call, seeded with it)
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS
    # the engine's log-prob of each sampled token (False: NaN). vLLM computes them for the batch on every decode
    # step and hands them over per sequence (asked flat: a few lists a sequence, not a Python object a token)
    logprobs: bool = True


# vLLM engine arguments jaxppo sets itself, each with the key that sets it (or why jaxppo decides it): refused in
# `rollout.engine_kwargs.vllm` (`own_engine_arg`: at the config's load, and by the engine for its other callers)
VLLM_OWN_ARGS: dict[str, str] = {
    "model": "vLLM gets the weights from JAX (model.path)",
    "load_format": "the weights are pushed from JAX",
    "skip_tokenizer_init": "jaxppo tokenizes and decodes",
    "tokenizer": "jaxppo tokenizes and decodes (data.tokenizer)",
    "dtype": "set model.dtype",
    "seed": "set trainer.seed",
    "logprobs_mode": "jaxppo's log-prob semantics are vLLM's processed_logprobs (jaxppo/rollout.py)",
    "enforce_eager": "set rollout.enforce_eager",
    "enable_prefix_caching": "set rollout.enable_prefix_caching",
    "enable_chunked_prefill": "set rollout.enable_chunked_prefill",
    "max_model_len": "set data.max_prompt_length + data.max_response_length",
    "max_num_seqs": "set rollout.max_num_seqs",
    "max_num_batched_tokens": "set rollout.max_num_batched_tokens",
    "gpu_memory_utilization": "set rollout.gpu_memory_utilization (0: the memory plan's share)",
    "kv_cache_memory_bytes": "the memory plan sizes vLLM's share (rollout.gpu_memory_utilization)",
    "enable_sleep_mode": "set rollout.free_cache_engine",
    "tensor_parallel_size": "vLLM runs on the trainer's device in its process (no parallel rollout yet)",
    "pipeline_parallel_size": "vLLM runs on the trainer's device in its process (no parallel rollout yet)",
    "data_parallel_size": "each training process runs its own vLLM replica",
    "distributed_executor_backend": "vLLM runs in the trainer's process",
}


def own_engine_arg(kwargs: Iterable[str]) -> str | None:
    """The refusal of the first of `rollout.engine_kwargs.vllm`'s names that jaxppo sets itself, or None."""
    for key in kwargs:
        if key in VLLM_OWN_ARGS:
            return f"rollout.engine_kwargs.vllm.{key}: jaxppo sets it; {VLLM_OWN_ARGS[key]}"
    return None


@dataclasses.dataclass
class Rollouts:
    """Prompt-major: samples of prompt 0, then prompt 1, ... Arrays are [num_samples, max_tokens]."""

    response_ids: np.ndarray  # int32, padded with pad_id after the end
    response_mask: np.ndarray  # float32, 1 on generated tokens (the EOS included)
    logprobs: np.ndarray  # float32, the engine's log-prob of each sampled token (0 on padding; NaN when not
    # asked for: Sampling.logprobs)
    finish_reasons: list[str]  # "stop" (EOS / stop id) or "length"
    prompt_index: np.ndarray  # int32, which prompt each sample answers

    @property
    def lengths(self) -> np.ndarray:
        return self.response_mask.sum(-1).astype(np.int32)

    @staticmethod
    def concat(parts: list["Rollouts"], prompts: list[int], pad_id: int = 0) -> "Rollouts":
        """One Rollouts of several, each answering `prompts[i]` consecutive prompts (indices renumbered in order),
        padded to the widest."""
        width = max(p.response_ids.shape[1] for p in parts)
        pad = lambda a, v: np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=v)  # noqa: E731
        offsets = np.cumsum([0] + list(prompts[:-1]))
        return Rollouts(np.concatenate([pad(p.response_ids, pad_id) for p in parts]),
                        np.concatenate([pad(p.response_mask, 0.0) for p in parts]),
                        np.concatenate([pad(p.logprobs, 0.0) for p in parts]),
                        [f for p in parts for f in p.finish_reasons],
                        np.concatenate([p.prompt_index + o for p, o in zip(parts, offsets)]).astype(np.int32))


@dataclasses.dataclass
class Sampled:
    """This process's scored samples of the step: its prompts' dataset rows and token ids, the rollouts
    (prompt-major, prompt_index into `rows`), the per-sequence scores (shaped) and the reward counts."""

    rows: np.ndarray
    prompts: list[np.ndarray]
    rollouts: Rollouts
    scores: np.ndarray
    counts: dict[str, Any]

    def take(self, prompts: np.ndarray) -> "Sampled":
        """The samples of these prompts (indices into `rows`), re-indexed in that order."""
        prompts = np.asarray(prompts, np.int64)
        order = np.concatenate([np.flatnonzero(self.rollouts.prompt_index == p) for p in prompts]) \
            if len(prompts) else np.zeros(0, np.int64)
        ro = self.rollouts
        new_index = np.repeat(np.arange(len(prompts)), [int((ro.prompt_index == p).sum()) for p in prompts])
        sub = Rollouts(ro.response_ids[order], ro.response_mask[order], ro.logprobs[order],
                       [ro.finish_reasons[i] for i in order], new_index.astype(np.int32))
        counts = {k: (v[order] if isinstance(v, np.ndarray) else v) for k, v in self.counts.items()}
        return Sampled(self.rows[prompts], [self.prompts[i] for i in prompts], sub, self.scores[order], counts)

    @staticmethod
    def concat(parts: list["Sampled"], pad_id: int = 0) -> "Sampled":
        """One Sampled of several (prompts renumbered in order; scalar counts summed, arrays joined)."""
        ro = Rollouts.concat([p.rollouts for p in parts], [len(p.rows) for p in parts], pad_id)
        keys = {k for p in parts for k in p.counts}
        n = [len(p.scores) for p in parts]
        counts = {}
        for k in keys:
            if any(isinstance(p.counts.get(k), np.ndarray) for p in parts):
                counts[k] = np.concatenate([p.counts.get(k, np.full(m, np.nan)) for p, m in zip(parts, n)])
            else:
                counts[k] = sum(float(p.counts.get(k, 0.0)) for p in parts)
        return Sampled(np.concatenate([p.rows for p in parts]), [x for p in parts for x in p.prompts], ro,
                       np.concatenate([p.scores for p in parts]), counts)


class RolloutEngine(Protocol):
    def update_weights(self, named_arrays: Iterable[tuple[str, Any]]) -> None:
        """Load new weights, given as (HF name, array with __dlpack__) pairs, consumed one at a time."""

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling) -> Rollouts: ...

    def sleep(self) -> None:
        """Release accelerator memory (weights / KV cache) while the trainer runs."""

    def wake(self) -> None: ...


def pack_responses(samples: Sequence[tuple[Sequence[int], Sequence[float] | None, str]], max_tokens: int,
                   pad_id: int, n: int, logprobs: bool = True) -> Rollouts:
    """(token ids, log-probs, finish reason) per sample, prompt-major with n per prompt -> padded Rollouts;
    without `logprobs` (not asked for) the log-probs are NaN whatever the engine computed."""
    num = len(samples)
    ids = np.full((num, max_tokens), pad_id, np.int32)
    mask = np.zeros((num, max_tokens), np.float32)
    lps = np.zeros((num, max_tokens), np.float32)
    reasons = []
    for i, (toks, lp, reason) in enumerate(samples):
        k = min(len(toks), max_tokens)
        ids[i, :k], mask[i, :k] = list(toks)[:k], 1.0
        if logprobs:
            lps[i, :k] = list(lp)[:k]
        else:
            lps[i] = np.nan
        reasons.append(reason)
    return Rollouts(ids, mask, lps, reasons, np.repeat(np.arange(num // n, dtype=np.int32), n))


def train_sequences(prompt_ids: np.ndarray, prompt_mask: np.ndarray, rollouts: Rollouts) -> dict[str, np.ndarray]:
    """Prompt (left-padded, [num_prompts, p]) + responses (right-padded) -> the engine's batch layout
    [num_samples, p + r]: input_ids, attention_mask (segment ids), positions, response_mask."""
    idx = rollouts.prompt_index
    ids = np.concatenate([prompt_ids[idx], rollouts.response_ids], axis=1).astype(np.int32)
    mask = np.concatenate([prompt_mask[idx], rollouts.response_mask], axis=1).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return {"input_ids": ids, "attention_mask": mask, "positions": positions,
            "response_mask": rollouts.response_mask.astype(np.float32)}
