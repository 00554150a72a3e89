"""`rollout.cuda_mps`: the run's own CUDA MPS daemon, so that the trainer and its vLLM helper processes share the
card's SMs at once instead of in time slices.

Without MPS the GPU runs one process's context at a time: rollouts one step ahead with the engine in a helper
(`rollout.engine_in_trainer=false`) have the helper's decode kernels and XLA's training kernels take turns, and each
turn costs a context switch. Under MPS every process is a client of one server, so the kernels of both run side by
side. Measured on one H100 (2026-12-05, docs/benchmarks.md, "1.5B one step ahead again, and under CUDA MPS"): the
1.5B one-step-ahead step 6.06 s against 6.50 s (5.66 s against 6.10 s with this key, 2026-12-08); at 0.5B it lost
(the helper's generation starved beside XLA's kernels, 3.31 s against 2.73 s on an H200). So it is a setting for a
config to choose, off by default. `rollout.cuda_mps_trainer_priority=below_normal` makes the trainer's process a
client of below-normal priority (`CUDA_MPS_CLIENT_PRIORITY=1`, read when its CUDA context is made) and its helper
engines' processes normal (`helper_environment`, applied where they are spawned), so that the daemon schedules the
decode's small kernels ahead of XLA's large ones instead of behind them; not yet measured in a run.

`start` runs before anything in this process touches the GPU (the memory plan's child, JAX, vLLM): a control daemon
with pipe and log directories of its own (a fresh directory under the system's temporary one, so no other MPS
daemon is reached and the socket path stays short), named in this process's environment, which every process
started here inherits. The trainer's process is a client until it exits, so the daemon cannot be stopped from
inside it: a small watcher process waits for the trainer's exit (however it ends, SIGKILL included) and then tells
the daemon to quit and removes its directory. Needs `nvidia-cuda-mps-control` on PATH and the card to itself: a card
in an exclusive compute mode, or one where another MPS server already runs, fails at CUDA's start in the trainer.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from jaxppo.errors import ConfigError, JaxppoError

CONTROL = "nvidia-cuda-mps-control"
ENV_KEYS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
PRIORITY_KEY = "CUDA_MPS_CLIENT_PRIORITY"  # a client's priority among the daemon's clients: 0 normal, 1 below normal
HELPER_PRIORITY_KEY = "JAXPPO_MPS_HELPER_PRIORITY"  # the PRIORITY_KEY a helper engine's process is started with
PRIORITIES = {"normal": "0", "below_normal": "1"}
QUIT_TIMEOUT_S = 120.0  # how long the watcher waits for the daemon to answer `quit` before it tells how to stop it
log = logging.getLogger(__name__)

# the watcher: waits for the trainer's process to end (on its pidfd), then stops the daemon
_WATCH = """
import os, select, shutil, subprocess, sys, time
pid, exe, where, patience = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
try:
    select.select([os.pidfd_open(pid)], [], [])
except ProcessLookupError:
    pass
except (AttributeError, OSError):  # no pidfd (a kernel before 5.3): ask once a second
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(1.0)
try:
    res = subprocess.run([exe], input="quit\\n", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=patience)
    failed = f"exit {res.returncode}: {res.stdout.strip()}" if res.returncode else ""
except subprocess.TimeoutExpired:
    failed = f"no answer to quit within {patience:g} s"
if failed:
    print(f"jaxppo: the run's MPS daemon did not quit ({failed}); stop it with "
          f"`echo quit | CUDA_MPS_PIPE_DIRECTORY={where} {exe}`", file=sys.stderr)
else:
    shutil.rmtree(where, ignore_errors=True)
"""


def _wants_a_daemon(cfg: Any) -> bool:
    """`rollout.cuda_mps`, outside a plan-only run (the memory plan's child runs under its parent's daemon)."""
    return cfg.rollout.cuda_mps and not cfg.trainer.plan_only


def start(cfg: Any) -> subprocess.Popen | None:
    """With `rollout.cuda_mps`: start the run's MPS daemon and name it in this process's environment (for the rest
    of the process's life), and the watcher that stops it once this process has ended (returned). Call it before the
    GPU is touched here. Without the key, or in a plan-only run (the memory plan's child inherits its parent's
    daemon through the environment): nothing (None)."""
    if not _wants_a_daemon(cfg):
        return None
    from jaxppo.distributed import topology_from_env

    if topology_from_env() is not None:
        raise ConfigError("rollout.cuda_mps=true runs in one process only (a daemon of its own per run; a run of "
                          "several processes would start one per process)")
    exe = shutil.which(CONTROL)
    if exe is None:
        raise ConfigError(f"rollout.cuda_mps=true: {CONTROL} is not on PATH (it comes with the NVIDIA driver's "
                          "utilities); set rollout.cuda_mps=false to run without MPS")
    where = Path(tempfile.mkdtemp(prefix="jaxppo-mps-"))
    named = {k: str(where) for k in ENV_KEYS}
    env = dict(os.environ, **named)
    try:
        res = subprocess.run([exe, "-d"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(where, ignore_errors=True)
        raise JaxppoError(f"rollout.cuda_mps=true: `{CONTROL} -d` did not start: {e}") from None
    if res.returncode != 0:
        shutil.rmtree(where, ignore_errors=True)
        raise JaxppoError(f"rollout.cuda_mps=true: `{CONTROL} -d` failed (exit {res.returncode}): "
                          f"{res.stdout.strip() or '(no output)'}")
    watcher = subprocess.Popen([sys.executable, "-c", _WATCH, str(os.getpid()), exe, str(where), str(QUIT_TIMEOUT_S)],
                               env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    os.environ.update(named)
    if cfg.rollout.cuda_mps_trainer_priority != "normal":  # this process's CUDA context is made after this
        os.environ.update({PRIORITY_KEY: PRIORITIES[cfg.rollout.cuda_mps_trainer_priority],
                           HELPER_PRIORITY_KEY: PRIORITIES["normal"]})
        log.info("CUDA MPS: the trainer's process a client of %s priority, its helper engines of normal priority",
                 cfg.rollout.cuda_mps_trainer_priority)
    log.info("CUDA MPS: a daemon of the run's own (pipe and log directory %s): the trainer's and its helpers' "
             "kernels share the card at once; stopped when this process ends", where)
    return watcher


def helper_environment() -> dict[str, str]:
    """What a helper engine's process takes over the trainer's environment: the MPS priority the run gives its
    helpers (normal) where it gave the trainer's process another (`rollout.cuda_mps_trainer_priority`); else
    nothing, and a priority the user set for the whole run stays theirs."""
    v = os.environ.get(HELPER_PRIORITY_KEY)
    return {} if v is None else {PRIORITY_KEY: v}


def check_started(cfg: Any) -> None:
    """Refuse a `rollout.cuda_mps` run whose process names no MPS daemon: a trainer built directly (not through
    `python -m jaxppo.train`) would otherwise run without MPS and say nothing. Call before the GPU is touched."""
    if _wants_a_daemon(cfg) and not os.environ.get(ENV_KEYS[0]):
        raise ConfigError(f"rollout.cuda_mps=true, but no MPS daemon is named in this process's environment "
                          f"({ENV_KEYS[0]}): call jaxppo.memory.before_the_gpu(cfg, argv) (or jaxppo.mps.start(cfg)) "
                          "before the trainer is built and before anything touches the GPU, as python -m jaxppo.train "
                          "does, or set rollout.cuda_mps=false")
