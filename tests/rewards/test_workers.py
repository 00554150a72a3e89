"""Reward code that ends its process or never returns: the sample scores 0 and is counted, the batch completes,
and the next batch is scored by fresh workers. The default config scores in worker processes, so a loop in C is
cut off at reward.timeout_s."""

import time

import pytest

from jaxppo.config import load_config
from jaxppo.rewards import score_batch
from jaxppo.rewards.workers import GRACE_S, RewardWorkers, pool, resolve
from tests.rewards import flaky_rewards  # noqa: F401  (registers test/* data sources)
from tests.train_helpers import ROOT


def test_sys_exit_in_process_scores_zero_and_is_counted():
    res = score_batch(["test/exits", "openai/gsm8k", "test/exits"], ["#### 3"] * 3, ["3"] * 3, num_workers=0)
    assert res.scores.tolist() == [0.0, 1.0, 0.0] and res.num_errors == 2


def test_a_dying_worker_costs_its_sample_only_and_is_replaced():
    workers = RewardWorkers(2)
    try:
        sources = ["openai/gsm8k", "test/os_exit", "openai/gsm8k", "test/exits", "openai/gsm8k"] * 4
        items = [(__import__("jaxppo.rewards.registry", fromlist=["x"]).get_reward_fn(s), s, "#### 3", "3", {}, 10.0)
                 for s in sources]
        results = workers.map(items, 10.0)
        for s, (score, why, _) in zip(sources, results):
            if s == "openai/gsm8k":
                assert score == 1.0 and why is None
            elif s == "test/os_exit":
                assert score == 0.0 and why.startswith("worker died (exit code 1)")
            else:
                assert score == 0.0 and why.startswith("SystemExit")
        assert workers.replaced == 4  # one per os._exit sample
        again = workers.map(items[:1] * 6, 10.0)  # the pool goes on with fresh workers
        assert [r[0] for r in again] == [1.0] * 6
    finally:
        workers.close()


def test_the_default_config_cuts_a_loop_in_c_off_at_the_timeout():
    cfg = load_config(ROOT / "configs" / "default.yaml", ["reward.timeout_s=1.0"])
    assert resolve(cfg.reward.num_workers) >= 1  # worker processes by default
    pool(resolve(cfg.reward.num_workers)).start()  # as the trainer does at setup
    t0 = time.monotonic()
    res = score_batch(["test/c_loop", "openai/gsm8k", "openai/gsm8k"], ["#### 3"] * 3, ["3"] * 3,
                      num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
    took = time.monotonic() - t0
    assert res.scores.tolist() == [0.0, 1.0, 1.0] and res.num_timeouts == 1, res
    assert took < cfg.reward.timeout_s + GRACE_S + 3.0, took  # the sample's deadline, not the batch's
    after = score_batch(["openai/gsm8k"] * 3, ["#### 3"] * 3, ["3"] * 3, num_workers=cfg.reward.num_workers)
    assert after.scores.tolist() == [1.0] * 3


@pytest.mark.parametrize("workers", [0, 2])
def test_reward_extras_and_errors_agree_in_and_out_of_process(workers):
    sources = ["openai/gsm8k", "test/raises", "test/nan", "test/exits"] * 3
    res = score_batch(sources, [f"#### {i}" for i in range(12)], [str(i % 5) for i in range(12)],
                      num_workers=workers)
    assert res.num_errors == 9 and res.scores.tolist() == [float(i % 5 == i) if i % 4 == 0 else 0.0
                                                           for i in range(12)]


def test_workers_score_on_through_the_signals_that_stop_the_trainer():
    """SIGINT and SIGTERM sent to every worker (a Ctrl-C or a scheduler's SIGTERM reaches the whole process group):
    none ends, none is replaced, and the next batch is scored by the same processes (jaxppo/helper_signals.py)."""
    import os
    import signal

    from jaxppo.rewards.registry import get_reward_fn

    workers = RewardWorkers(2)
    try:
        items = [(get_reward_fn("openai/gsm8k"), "openai/gsm8k", "#### 3", "3", {}, 10.0)] * 4
        assert [r[0] for r in workers.map(items, 10.0)] == [1.0] * 4
        pids = [w.proc.pid for w in workers._workers]
        for pid in pids:
            for sig in (signal.SIGINT, signal.SIGTERM):
                os.kill(pid, sig)
        assert [r[0] for r in workers.map(items, 10.0)] == [1.0] * 4  # each answers after both signals
        assert workers.replaced == 0 and [w.proc.pid for w in workers._workers] == pids
    finally:
        workers.close()
