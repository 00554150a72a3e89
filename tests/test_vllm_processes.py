"""bridge/engines/vllm_processes.py's protocol with its helpers, against helpers played by threads on the other end
of real pipes (no vLLM): a push does not wait for the helpers' loads, the next request does, and a failed load is
raised there, naming the push. The engines for real: tests/test_train.py (`vllm-two-processes`, `vllm-helper-only`)."""

import multiprocessing
import threading

import numpy as np
import pytest
import torch

from bridge.engines.vllm_processes import VLLMProcesses
from jaxppo.rollout import Rollouts, Sampling


class FakeHelper:
    """`_serve`'s answers, one request at a time; a load blocks until `release` is set (or fails, `fail_load`)."""

    def __init__(self, conn, fail_load: bool = False):
        self.conn, self.fail_load = conn, fail_load
        self.release = threading.Event()
        self.log: list[str] = []
        self.loaded: list[float] = []  # the shared copy's first value at each load
        self.shared: dict[str, torch.Tensor] = {}
        self.profiles: list = []  # each generation's (directory, tools) to profile it with
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                msg = self.conn.recv()
            except EOFError:  # the test's end closed
                return
            op = msg[0]
            self.log.append(op)
            if op == "stop":
                return
            if op == "shared":
                self.shared = msg[1]
                self.conn.send(("ok", None))
            elif op == "load":
                assert self.release.wait(60), "the test never released the load"
                if self.fail_load:
                    self.conn.send(("error", "ValueError: no parameter named 'w'"))
                    return
                self.loaded.append(float(self.shared["w"].flatten()[0]))
                self.conn.send(("ok", None))
            elif op == "generate":
                self.profiles.append(msg[3])
                n = len(msg[1])
                ro = Rollouts(np.ones((n, 2), np.int32), np.ones((n, 2), np.float32), np.zeros((n, 2), np.float32),
                              ["stop"] * n, np.arange(n, dtype=np.int32))
                self.conn.send(("ok", (ro, 0.5, 0.25)))


def processes(helpers: list[FakeHelper], conns) -> VLLMProcesses:
    """A `VLLMProcesses` of helpers only (`in_trainer=False`) whose pipes lead to `helpers`."""
    vp = object.__new__(VLLMProcesses)
    vp._protocol_state()
    vp.local, vp.start_s, vp.pad_token_id, vp.gpu, vp._dtype, vp._info = None, 0.0, 0, False, torch.float32, {}
    vp._conns = list(conns)
    return vp


def pair(fail_load=False):
    parent, child = multiprocessing.Pipe()
    return parent, FakeHelper(child, fail_load)


def test_a_push_returns_before_the_helpers_load_and_the_next_generation_waits_for_it():
    (c1, h1), (c2, h2) = pair(), pair()
    vp = processes([h1, h2], [c1, c2])
    vp.update_weights([("w", torch.full((2, 2), 3.0))])  # returns with both loads still blocked
    assert vp._loading == {1, 2} and h1.loaded == [] and h2.loaded == []
    h1.release.set()
    h2.release.set()
    ro = vp.generate([[1, 2], [3], [4, 5]], Sampling(max_tokens=2, temperature=1.0, seed=0))
    assert len(ro.finish_reasons) == 3 and h1.loaded == [3.0] and h2.loaded == [3.0]
    assert h1.log == ["shared", "load", "generate"] and vp._loading == set()
    assert vp.call_timings() == {"timing_s/gen_engine0": 0.5, "perf/cpu_s/gen_engine0": 0.25,
                                 "timing_s/gen_engine1": 0.5, "perf/cpu_s/gen_engine1": 0.25}
    vp.close()


def test_the_next_push_waits_for_the_last_load_before_it_writes_the_shared_copy_again():
    (c1, h1), = [pair()]
    vp = processes([h1], [c1])
    vp.update_weights([("w", torch.full((3,), 1.0))])  # its load blocked in the helper
    second = threading.Thread(target=vp.update_weights, args=([("w", torch.full((3,), 2.0))],))
    second.start()  # no generation between the two pushes
    second.join(2.0)
    assert second.is_alive(), "the second push went on while the helper was still loading the first"
    h1.release.set()
    second.join(60)
    vp.generate([[1]], Sampling(max_tokens=2, temperature=1.0, seed=0))
    assert h1.loaded == [1.0, 2.0], h1.loaded  # each load read its own push's values
    vp.close()


def test_a_failed_load_is_raised_at_the_next_request_naming_the_push():
    (c1, h1), = [pair(fail_load=True)]
    vp = processes([h1], [c1])
    h1.release.set()
    vp.update_weights([("w", torch.zeros(2))])  # the push itself returns
    with pytest.raises(RuntimeError, match=r"engine process 1, the weight push: ValueError: no parameter named 'w'"):
        vp.generate([[1]], Sampling(max_tokens=2, temperature=1.0, seed=0))
    assert 1 in vp._ended


def test_a_profiled_steps_generations_are_profiled_by_each_helper_in_a_directory_of_their_own(tmp_path):
    (c1, h1), (c2, h2) = pair(), pair()
    vp = processes([h1, h2], [c1, c2])
    sampling = Sampling(max_tokens=2, temperature=1.0, seed=0)
    vp.generate([[1], [2]], sampling)
    vp.profile_calls(tmp_path, ("torch", "python"))
    vp.generate([[1], [2]], sampling)
    vp.generate([[1], [2]], sampling)
    vp.profile_calls(None)
    vp.generate([[1], [2]], sampling)
    for j, h in enumerate((h1, h2)):
        assert h.profiles == [(None, ()), (str(tmp_path / f"engine{j}_call0"), ("torch", "python")),
                              (str(tmp_path / f"engine{j}_call1"), ("torch", "python")), (None, ())]
    vp.close()


def test_profiled_call_writes_the_python_profile_of_what_it_encloses(tmp_path):
    from jaxppo.profiling import profiled_call

    def busy_function_to_find():
        return sum(i * i for i in range(20000))

    with profiled_call(tmp_path / "p", ("python",)):
        busy_function_to_find()
    assert "busy_function_to_find" in (tmp_path / "p" / "python_profile.txt").read_text()
    with profiled_call(None, ("python",)):
        busy_function_to_find()
    with profiled_call(tmp_path / "q", ("jax",)):  # no tool of this process: nothing written
        busy_function_to_find()
    assert not (tmp_path / "q").exists()



def _middle(helper_end, ready) -> None:
    """A trainer's stand-in: starts a helper's stand-in on the given pipe end, reports its pid, waits to be killed."""
    import time

    proc = multiprocessing.get_context("spawn").Process(target=_helper_stand_in, args=(helper_end,), daemon=False)
    proc.start()
    helper_end.close()
    ready.send(proc.pid)
    time.sleep(600)


def _helper_stand_in(conn) -> None:
    """Takes the helpers' signals, then answers each message with its signals' dispositions until the pipe closes."""
    import signal

    from jaxppo.helper_signals import helper_signals

    helper_signals()
    while True:
        conn.recv()
        conn.send([signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM)])


def test_a_helper_outlives_the_signals_that_stop_the_trainer_and_not_the_trainer():
    """A Ctrl-C or a scheduler's SIGTERM reaches the helpers too (one process group): they ignore both, since the
    trainer still needs them to finish the batch in flight before its checkpoint; when the trainer itself ends
    (SIGKILL here: nothing of it runs after) the helper is killed with it (PR_SET_PDEATHSIG), never left holding
    its share of the card."""
    import os
    import signal

    ctx = multiprocessing.get_context("spawn")
    ours, helper_end = ctx.Pipe()
    ready, ready_end = ctx.Pipe()
    middle = ctx.Process(target=_middle, args=(helper_end, ready_end), daemon=False)
    middle.start()
    helper_end.close()
    try:
        assert ready.poll(120), "the stand-ins did not start"
        helper = ready.recv()
        ours.send("dispositions")
        assert ours.recv() == [True, True]
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(helper, sig)
        ours.send("still there?")  # a signal that ended it would end it before it could answer
        assert ours.recv() == [True, True]
        os.kill(middle.pid, signal.SIGKILL)
        middle.join(30)
        assert ours.poll(30), "the helper outlived its trainer"
        with pytest.raises(EOFError):  # its end of the pipe closed: it ended
            ours.recv()
    finally:
        if middle.is_alive():
            middle.kill()
        try:
            os.kill(helper, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass
