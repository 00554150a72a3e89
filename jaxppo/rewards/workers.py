"""Reward worker processes, each sample under its own deadline.

A reward function is user code: it may loop in C where no signal reaches it, call `sys.exit` or `os._exit`, or
crash the interpreter. In a worker process none of that reaches the trainer: the worker scores samples one by
one (each under its own SIGALRM timer there, `registry._score_one`) and reports each result as it finishes, so
the trainer knows which sample a worker is on and since when. A worker still on one sample `GRACE_S` seconds
past `timeout_s` is killed (that sample scores 0 as timed out); a worker that dies takes only the sample it was
on (scored 0 as an error, with its exit code); the rest of its share goes to the others, and a fresh worker
replaces it. The pool lives for the process (workers are spawned, not forked: the trainer runs JAX threads) and
is started early (`start`) so that their imports overlap with the trainer's setup.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection as mpc
import os
import time
from collections import deque
from typing import Any

GRACE_S = 1.0  # past timeout_s, the worker's own timer had its chance: the trainer kills it
CHUNK = 16  # samples sent to a worker at a time (it reports each one)


def _serve(conn: mpc.Connection) -> None:
    """A worker's loop: [(index, item), ...] in, (index, result) out per sample; None ends it. Ctrl-C or a
    scheduler's SIGTERM reaches the whole process group: the trainer decides how to stop, the worker finishes what
    it was given (jaxppo/helper_signals.py), and it is killed when the trainer ends."""
    from jaxppo.helper_signals import helper_signals
    from jaxppo.rewards.registry import _score_one

    helper_signals()
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the trainer went away
            return
        if job is None:
            return
        for index, item in job:
            conn.send((index, _score_one(*item)))


class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True, name="jaxppo-reward")
        self.proc.start()
        child.close()
        self.pending: deque[int] = deque()  # sample indices sent and not yet answered, in order
        self.since = 0.0  # when the sample at the head of `pending` started (the last answer or the send)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardWorkers:
    """`n` worker processes scoring (fn, data_source, solution, ground_truth, extra_info, timeout_s) items."""

    def __init__(self, n: int):
        self.n = n
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self.replaced = 0  # workers killed or dead and replaced, over the pool's life

    def start(self) -> None:
        while len(self._workers) < self.n:
            self._workers.append(_Worker(self._ctx))

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.kill()
        self._workers = []

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self._ctx)
        self.replaced += 1

    def map(self, items: list[tuple], timeout_s: float) -> list[tuple[float, str | None, dict]]:
        """Each item's `_score_one` result, in order. A sample whose worker outlives its deadline scores
        (0, "timed out ..."); one whose worker dies, (0, "worker died ...")."""
        self.start()
        results: list[Any] = [None] * len(items)
        todo = deque(range(len(items)))
        left = len(items)
        while left:
            now = time.monotonic()
            for w in self._workers:  # keep every worker busy
                if not w.pending and todo:
                    chunk = [todo.popleft() for _ in range(min(CHUNK, len(todo)))]
                    try:
                        w.conn.send([(i, items[i]) for i in chunk])
                    except (OSError, ValueError):  # died while idle: give the samples back, replace it
                        todo.extendleft(reversed(chunk))
                        self._replace(w)
                        continue
                    w.pending.extend(chunk)
                    w.since = now
            busy = [w for w in self._workers if w.pending]
            wait = None
            if timeout_s > 0:
                wait = max(0.0, min(w.since + timeout_s + GRACE_S for w in busy) - time.monotonic())
            ready = mpc.wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=wait)
            for w in busy:
                if w.conn in ready:
                    try:
                        while w.conn.poll():
                            index, res = w.conn.recv()
                            w.pending.remove(index)
                            results[index] = res
                            left -= 1
                            w.since = time.monotonic()
                        continue
                    except (EOFError, OSError):
                        pass  # died: handled below
                    if not w.pending:
                        continue
                if w.proc.sentinel in ready or not w.proc.is_alive():
                    w.proc.join(5)  # its pipe closes a moment before the process is reaped
                    self._lose(w, results, todo, f"worker died (exit code {w.proc.exitcode})")
                    left -= 1
                elif timeout_s > 0 and time.monotonic() - w.since > timeout_s + GRACE_S:
                    self._lose(w, results, todo, f"timed out after {timeout_s}s (worker killed)")
                    left -= 1
        return results

    def _lose(self, w: _Worker, results: list, todo: deque, why: str) -> None:
        """The worker's current sample scores 0 for `why`; the rest of its share goes back to the queue."""
        head = w.pending.popleft()
        results[head] = (0.0, why, {})
        todo.extendleft(reversed(w.pending))
        w.pending.clear()
        self._replace(w)


_POOL: RewardWorkers | None = None


def pool(n: int) -> RewardWorkers:
    """The process's pool of `n` workers (a pool of another size is closed first)."""
    global _POOL
    if _POOL is not None and _POOL.n != n:
        _POOL.close()
        _POOL = None
    if _POOL is None:
        _POOL = RewardWorkers(n)
    return _POOL


def resolve(num_workers: int) -> int:
    """`reward.num_workers`: -1 is min(4, CPUs)."""
    return min(4, os.cpu_count() or 1) if num_workers < 0 else num_workers


@atexit.register
def _close() -> None:
    if _POOL is not None:
        _POOL.close()


__all__ = ["RewardWorkers", "pool", "resolve", "GRACE_S"]
