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

if "test/exits" not in REWARD_FUNCTIONS:
    import os
    import sys

    @REWARD_FUNCTIONS.register("test/exits")
    def exits(solution, ground_truth, extra_info):
        sys.exit(0)  # ends the process quietly, with status 0, unless caught

    @REWARD_FUNCTIONS.register("test/os_exit")
    def os_exit(solution, ground_truth, extra_info):
        os._exit(1)  # no exception, no cleanup: only a process boundary stops it

    @REWARD_FUNCTIONS.register("test/c_loop")
    def c_loop(solution, ground_truth, extra_info):
        return float(sum(range(10**14)) > 0)  # C code that never returns to Python: no signal handler runs
