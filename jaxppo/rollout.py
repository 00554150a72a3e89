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
    seed: int | None = None  # same seed -> same samples (vLLM: per request seed + index)
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS


@dataclasses.dataclass
class Rollouts:
    """Prompt-major: samples of prompt 0, then prompt 1, ... Arrays are [num_samples, max_tokens]."""

    response_ids: np.ndarray  # int32, padded with pad_id after the end
    response_mask: np.ndarray  # float32, 1 on generated tokens (the EOS included)
    logprobs: np.ndarray  # float32, the engine's log-prob of each sampled token (0 on padding)
    finish_reasons: list[str]  # "stop" (EOS / stop id) or "length"
    prompt_index: np.ndarray  # int32, which prompt each sample answers

    @property
    def lengths(self) -> np.ndarray:
        return self.response_mask.sum(-1).astype(np.int32)


class RolloutEngine(Protocol):
    def update_weights(self, named_arrays: Iterable[tuple[str, Any]]) -> None:
        """Load new weights, given as (HF name, array with __dlpack__) pairs, consumed one at a time."""

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling) -> Rollouts: ...

    def sleep(self) -> None:
        """Release accelerator memory (weights / KV cache) while the trainer runs."""

    def wake(self) -> None: ...


def pack_responses(samples: Sequence[tuple[Sequence[int], Sequence[float], str]], max_tokens: int, pad_id: int,
                   n: int) -> Rollouts:
    """(token ids, log-probs, finish reason) per sample, prompt-major with n per prompt -> padded Rollouts."""
    num = len(samples)
    ids = np.full((num, max_tokens), pad_id, np.int32)
    mask = np.zeros((num, max_tokens), np.float32)
    lps = np.zeros((num, max_tokens), np.float32)
    reasons = []
    for i, (toks, lp, reason) in enumerate(samples):
        k = min(len(toks), max_tokens)
        ids[i, :k], mask[i, :k], lps[i, :k] = list(toks)[:k], 1.0, list(lp)[:k]
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
