"""Reward functions that misbehave, registered under test data sources (importable by worker processes)."""

import time

from jaxppo.rewards import REWARD_FUNCTIONS

if "test/raises" not in REWARD_FUNCTIONS:
    @REWARD_FUNCTIONS.register("test/raises")
    def raises(solution, ground_truth, extra_info):
        raise ZeroDivisionError("bad reward code")

    @REWARD_FUNCTIONS.register("test/nan")
    def nan(solution, ground_truth, extra_info):
        return float("nan")

    @REWARD_FUNCTIONS.register("test/hangs")
    def hangs(solution, ground_truth, extra_info):
        time.sleep(10**6)  # a reward function that never returns (regex blow-up, network I/O, a deadlock)
        return 1.0
