"""Reward functions by `data_source`, and batch scoring that never crashes a run.

A reward function is `fn(solution_str, ground_truth, extra_info) -> float`. A function that raises,
returns a non-number, NaN or inf, or (in parallel mode) runs past the timeout, scores 0 for that
sample; the count is reported (`reward/errors`) and the first few offenders are logged.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math as pymath
import multiprocessing
import time
from typing import Any, Callable, Sequence

import numpy as np

from jaxppo.registry import Registry
from jaxppo.rewards import gsm8k, math

log = logging.getLogger(__name__)
RewardFn = Callable[[str, str, dict], float]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")
DEFAULT = "default"


@REWARD_FUNCTIONS.register("openai/gsm8k", "synthetic/arithmetic")
def _gsm8k(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    return gsm8k.compute_score(solution_str, ground_truth)


@REWARD_FUNCTIONS.register("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "math", DEFAULT)
def _math(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    return math.compute_score(solution_str, ground_truth)


def get_reward_fn(data_source: str) -> RewardFn:
    """The function registered for `data_source`, or the default (\\boxed{} math comparison)."""
    return REWARD_FUNCTIONS.get(data_source if data_source in REWARD_FUNCTIONS else DEFAULT)


@dataclasses.dataclass
class ScoreResult:
    scores: np.ndarray  # [n] float32
    num_errors: int  # raised, NaN/inf or non-number
    num_timeouts: int


def _score_one(fn: RewardFn, solution: str, ground_truth: str, extra_info: dict) -> tuple[float, str | None]:
    try:
        value = float(fn(solution, ground_truth, extra_info))
    except Exception as e:  # noqa: BLE001 - any failure of user reward code scores 0, never crashes the run
        return 0.0, f"{type(e).__name__}: {e}"
    if not pymath.isfinite(value):
        return 0.0, f"returned {value}"
    return value, None


def _score_chunk(items: list[tuple]) -> list[tuple[float, str | None]]:
    return [_score_one(*it) for it in items]


_POOL: cf.ProcessPoolExecutor | None = None


def _pool(workers: int) -> cf.ProcessPoolExecutor:
    global _POOL
    if _POOL is None:  # spawn: forking a process that runs JAX threads is unsafe
        _POOL = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    return _POOL


def _kill_pool() -> None:
    """A timed-out worker may never return: terminate the pool so the next batch gets fresh workers."""
    global _POOL
    if _POOL is not None:
        procs = list(getattr(_POOL, "_processes", {}).values())
        _POOL.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            proc.terminate()
        _POOL = None


def score_batch(data_sources: Sequence[str], solutions: Sequence[str], ground_truths: Sequence[str],
                extra_infos: Sequence[dict[str, Any]] | None = None, *, parallel_threshold: int = 1024,
                num_workers: int = 4, timeout_s: float = 60.0, max_logged: int = 3) -> ScoreResult:
    """Score every sample; in `num_workers` processes when the batch has >= `parallel_threshold` samples,
    the whole batch bounded by `timeout_s` (samples of a chunk not done by then score 0)."""
    n = len(solutions)
    extra_infos = extra_infos if extra_infos is not None else [{}] * n
    # functions travel to worker processes by reference (module + name), so user functions registered in
    # an importable module work in parallel mode too
    items = [(get_reward_fn(ds), sol, gt, ex) for ds, sol, gt, ex in zip(data_sources, solutions, ground_truths,
                                                                            extra_infos)]
    results: list[tuple[float, str | None]] = []
    timeouts = 0
    if n >= parallel_threshold and num_workers > 1:
        size = -(-n // num_workers)
        chunks = [items[i:i + size] for i in range(0, n, size)]
        futures = [_pool(num_workers).submit(_score_chunk, c) for c in chunks]
        deadline = time.monotonic() + timeout_s
        for chunk, fut in zip(chunks, futures):
            try:
                results.extend(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except cf.TimeoutError:
                timeouts += len(chunk)
                results.extend([(0.0, f"timed out after {timeout_s}s")] * len(chunk))
        if timeouts:
            _kill_pool()
    else:
        results = _score_chunk(items)
    errors = [(i, msg) for i, (_, msg) in enumerate(results) if msg is not None]
    for i, msg in errors[:max_logged]:
        log.warning("reward for sample %d (data_source=%r) scored 0: %s; response tail: %r", i, data_sources[i],
                    msg, solutions[i][-200:])
    return ScoreResult(np.asarray([s for s, _ in results], np.float32), len(errors) - timeouts, timeouts)
