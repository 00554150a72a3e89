"""Batch scoring never crashes a run: failures score 0, are counted and logged."""

import logging
import time

import pytest

from jaxppo.rewards import get_reward_fn, score_batch
from tests.rewards import flaky_rewards  # noqa: F401  (registers test/* data sources)


def test_failures_score_zero_and_are_counted(caplog):
    sources = ["openai/gsm8k", "test/raises", "test/nan", "openai/gsm8k", "test/raises"]
    with caplog.at_level(logging.WARNING):
        res = score_batch(sources, ["#### 3"] * 5, ["3"] * 5, max_logged=2)
    assert res.scores.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert res.num_errors == 3 and res.num_timeouts == 0
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "ZeroDivisionError" in logged[0] and "nan" in logged[1]


def test_unknown_data_source_uses_default():
    assert get_reward_fn("somebody/new-dataset") is get_reward_fn("default")


def test_a_hanging_reward_function_times_out_in_process():
    t0 = time.monotonic()
    res = score_batch(["test/hangs", "openai/gsm8k", "test/hangs"], ["#### 1"] * 3, ["1"] * 3, timeout_s=0.3)
    assert res.scores.tolist() == [0.0, 1.0, 0.0] and res.num_timeouts == 2 and res.num_errors == 0
    assert time.monotonic() - t0 < 5.0


@pytest.mark.slow
def test_worker_scoring_matches_serial_and_times_out():
    n = 40
    sources = ["openai/gsm8k", "test/raises"] * (n // 2)
    sols = [f"#### {i}" for i in range(n)]
    gts = [str(i if i % 4 else i + 1) for i in range(n)]
    serial = score_batch(sources, sols, gts)
    parallel = score_batch(sources, sols, gts, num_workers=2)
    assert parallel.scores.tolist() == serial.scores.tolist() and parallel.num_errors == serial.num_errors
    t0 = time.monotonic()
    hung = score_batch(["test/hangs"] * 4 + ["openai/gsm8k"] * 4, ["#### 1"] * 8, ["1"] * 8, num_workers=2,
                       timeout_s=1.0)
    assert hung.num_timeouts == 4 and hung.scores.tolist() == [0.0] * 4 + [1.0] * 4
    assert time.monotonic() - t0 < 20.0  # each hung sample stopped by its worker's timer, not the batch deadline
    after = score_batch(["openai/gsm8k"] * 4, ["#### 1"] * 4, ["1"] * 4, num_workers=2)
    assert after.scores.tolist() == [1.0] * 4  # the workers go on scoring
