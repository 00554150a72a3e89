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
        time.sleep(3.0)  # stands for a reward function that never returns in time (regex blow-up, I/O)
        return 1.0
