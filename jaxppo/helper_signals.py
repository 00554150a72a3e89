"""What a process the trainer starts to help it (a vLLM engine's, bridge/engines/vllm_processes.py; a reward
worker, jaxppo/rewards/workers.py) does with signals: a Ctrl-C or a scheduler's SIGTERM reaches the whole process
group, and the trainer then finishes its step (one step ahead: waits for the batch in flight) and checkpoints it, so
a helper ended by the same signal would lose that work and the checkpoint with it. The trainer decides when its
helpers end; when it ends, however it ends, they are killed with it."""

from __future__ import annotations

import signal


def helper_signals() -> None:
    """In a helper process: SIGINT and SIGTERM ignored; SIGKILL when the process that started it ends
    (PR_SET_PDEATHSIG; a helper never outlives its trainer holding memory or a device)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the pipe's end still ends an idle helper
        pass


__all__ = ["helper_signals"]
