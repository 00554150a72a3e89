"""Reward functions by `data_source`, and batch scoring that never crashes or hangs a run.

A registered reward function is `fn(solution_str, ground_truth, extra_info) -> float`; a user's function from
a file (`jaxppo.rewards.custom`) takes verl's keyword arguments (data_source first) and may return a dict with
a `score` key, other numbers (reported per key) and `pred`, the answer it extracted (majority voting). A function that raises,
returns a non-number, NaN or inf, or runs past `timeout_s` scores 0 for that sample; the counts are
reported (`reward/errors`) and the first few offenders are logged; so does one that ends its process
(`sys.exit`, any BaseException but KeyboardInterrupt).

By default samples run in worker processes (`jaxppo.rewards.workers`), each under its own timer there; a worker
stuck where no signal reaches it (a loop in C) is killed once its sample is past the limit, and one that dies
(`os._exit`, a crash) is replaced: either way only that sample scores 0 and the step completes. With
`reward.num_workers=0` samples run in the trainer's process under a SIGALRM timer (main thread only), which
cannot stop a loop in C or survive `os._exit`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math as pymath
import signal
import threading
from typing import Any, Callable, Sequence

import numpy as np

from jaxppo.registry import Registry
from jaxppo.rewards import gsm8k, math, math_dapo, workers

log = logging.getLogger(__name__)
RewardFn = Callable[[str, str, dict], float]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")
DEFAULT = "default"


@REWARD_FUNCTIONS.register("openai/gsm8k", "synthetic/arithmetic")
def _gsm8k(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    return gsm8k.compute_score(solution_str, ground_truth)


@REWARD_FUNCTIONS.register("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", DEFAULT)
def _math(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    return math.compute_score(solution_str, ground_truth)


# verl's routing: these sources, and every source starting with "aime", to DAPO's "Answer:" rule (+1 / -1)
MATH_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
PREFIXES = {"aime": "math_dapo"}


@REWARD_FUNCTIONS.register(*MATH_DAPO_SOURCES)
def _math_dapo(solution_str: str, ground_truth: str, extra_info: dict) -> dict:
    return math_dapo.compute_score(solution_str, ground_truth)


def rule_for(data_source: str) -> str | None:
    """The registered name that scores `data_source` (itself, or its prefix's rule), None when none does."""
    if data_source in REWARD_FUNCTIONS:
        return data_source
    return next((rule for prefix, rule in PREFIXES.items() if data_source.startswith(prefix)), None)


def get_reward_fn(data_source: str, default_rule: str | None = None) -> RewardFn:
    """The function registered for `data_source` (or its prefix: `aime*`), else `default_rule`'s, else the
    default (\\boxed{} math). Runs check at dataset load that every source is covered
    (`jaxppo.setup.check_reward_sources`)."""
    return REWARD_FUNCTIONS.get(rule_for(data_source) or default_rule or DEFAULT)


# the answer a response gives, for majority voting in validation (`maj@n`): one extractor per reward rule,
# normalised so that equal answers vote together (numbers as exact fractions, other text without spaces)
ANSWER_EXTRACTORS: Registry[Callable[[str], "str | None"]] = Registry("answer extractor")


def _canonical(answer: str | None) -> str | None:
    if answer is None:
        return None
    number = math.parse_number(answer)
    return str(number) if number is not None else "".join(answer.split())


@ANSWER_EXTRACTORS.register("openai/gsm8k", "synthetic/arithmetic")
def _gsm8k_answer(solution_str: str) -> str | None:
    return _canonical(gsm8k.extract_solution(solution_str, "strict"))


@ANSWER_EXTRACTORS.register("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", DEFAULT)
def _math_answer(solution_str: str) -> str | None:
    return _canonical(math.last_boxed(solution_str))


@ANSWER_EXTRACTORS.register(*MATH_DAPO_SOURCES)
def _math_dapo_answer(solution_str: str) -> str | None:
    return math_dapo.judge(solution_str, "")[1]


def get_answer_extractor(data_source: str, default_rule: str | None = None) -> Callable[[str], "str | None"]:
    """The extractor of the rule that scores `data_source` (`default_rule`'s, or the default's, for unregistered
    sources)."""
    return ANSWER_EXTRACTORS.get(rule_for(data_source) or default_rule or DEFAULT)


@dataclasses.dataclass
class ScoreResult:
    scores: np.ndarray  # [n] float32
    num_errors: int  # raised, NaN/inf or non-number
    num_timeouts: int
    extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # [n] float64 per key (NaN: absent)
    preds: list[str | None] | None = None  # a user's function's `pred` entries (verl's vote key), when it gives them


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise `_Timeout` in this thread after `seconds` (SIGALRM; only the main thread can take signals, so
    elsewhere there is no limit and the caller must bound the time itself)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _score_one(fn: RewardFn, data_source: str, solution: str, ground_truth: str, extra_info: dict,
               timeout_s: float = 0.0) -> tuple[float, str | None, dict[str, float]]:
    """(score, None, extras) or (0.0, why, {}): a failure of the user's reward code scores 0, never crashes the
    run. A dict result gives the score under `score` and its other numeric entries as extras."""
    extras: dict[str, Any] = {}  # numeric extras, and `pred`
    try:
        with _time_limit(timeout_s):
            if getattr(fn, "takes_data_source", False):
                out = fn(data_source, solution, ground_truth, extra_info)
            else:
                out = fn(solution, ground_truth, extra_info)
        if isinstance(out, dict):
            if "score" not in out:
                return 0.0, f"returned a dict without a 'score' key (keys {sorted(out)[:8]})", {}
            extras = {str(k): float(v) for k, v in out.items()
                      if k not in ("score", "pred") and isinstance(v, (int, float, bool))}
            pred = out.get("pred")
            if pred is not None:  # the answer it extracted, for majority voting (verl's key): a number stays a
                # number (1 and 1.0 are one vote, as in verl), anything but a scalar votes by its text
                extras["pred"] = pred if isinstance(pred, (str, int, float, bool)) else str(pred)
            out = out["score"]
        value = float(out)
    except _Timeout:
        return 0.0, f"timed out after {timeout_s}s", {}
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - any failure of user reward code scores 0, sys.exit() included
        return 0.0, f"{type(e).__name__}: {e}", {}
    if not pymath.isfinite(value):
        return 0.0, f"returned {value}", {}
    return value, None, extras


def _is_timeout(msg: str | None) -> bool:
    return msg is not None and msg.startswith("timed out")


def score_batch(data_sources: Sequence[str], solutions: Sequence[str], ground_truths: Sequence[str],
                extra_infos: Sequence[dict[str, Any]] | None = None, *, num_workers: int = 0,
                timeout_s: float = 30.0, max_logged: int = 3, reward_fn: RewardFn | None = None,
                default_rule: str | None = None) -> ScoreResult:
    """Score every sample, each within `timeout_s` seconds (0: no limit): in this process when
    `num_workers` is 0, else in that many worker processes (-1: min(4, CPUs)). `reward_fn` overrides the
    data-source lookup (a user's function from a file; it must be importable by reference for worker processes);
    `default_rule` scores the sources no rule is registered for."""
    n = len(solutions)
    extra_infos = extra_infos if extra_infos is not None else [{}] * n
    # functions travel to worker processes by reference (module + name), so user functions registered in
    # an importable module work in worker processes too
    items = [(reward_fn or get_reward_fn(ds, default_rule), ds, sol, gt, ex, timeout_s)
             for ds, sol, gt, ex in zip(data_sources, solutions, ground_truths, extra_infos)]
    num_workers = workers.resolve(num_workers)
    if num_workers == 0:
        results = [_score_one(*it) for it in items]
    else:
        results = workers.pool(num_workers).map(items, timeout_s)
    errors = [(i, msg) for i, (_, msg, _) in enumerate(results) if msg is not None]
    for i, msg in errors[:max_logged]:
        log.warning("reward for sample %d (data_source=%r) scored 0: %s; response tail: %r", i, data_sources[i],
                    msg, solutions[i][-200:])
    timeouts = sum(_is_timeout(msg) for _, msg in errors)
    keys = sorted({k for _, _, ex in results for k in ex} - {"pred"})
    extras = {k: np.asarray([ex.get(k, np.nan) for _, _, ex in results], np.float64) for k in keys}
    preds = [ex.get("pred") for _, _, ex in results] if any("pred" in ex for _, _, ex in results) else None
    return ScoreResult(np.asarray([s for s, _, _ in results], np.float32), len(errors) - timeouts, timeouts, extras,
                       preds)
