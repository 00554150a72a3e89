"""`python -m jaxppo.launch --nproc N [--coordinator HOST:PORT] [--node-rank R --nnodes M] -- <train args>`

Starts N processes of `python -m jaxppo.train <train args>` (or `--script S`: `python S <args>`, e.g.
scripts/bench_ppo_step.py) on this host, one per GPU (or N CPU
processes), joined into one global mesh by `jax.distributed` (jaxppo/distributed.py): it sets the
coordinator, each process's id and local device (its GPU listed first in CUDA_VISIBLE_DEVICES, so JAX,
torch and an in-process vLLM all use it as device 0), and `NCCL_NVLS_ENABLE=0`. SIGINT / SIGTERM are
forwarded to every process (they checkpoint and exit 0). If one process dies, the others are stopped
(SIGTERM, then SIGKILL after --grace seconds) and the launcher exits with the failed process's code:
no orphan hangs on a collective. Multi-host: the same command on every host with --coordinator of
host 0, --nnodes and --node-rank. torchrun and SLURM can start `python -m jaxppo.train` directly
instead: their environment is understood too.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return len([line for line in out.stdout.splitlines() if line.startswith("GPU")])
    except (OSError, subprocess.SubprocessError):
        return 0


def gpu_env(local: int, visible: list[str]) -> dict[str, str]:
    """Process `local`'s GPU first in its visible list: JAX takes device 0 (local_device_ids), and so do
    torch and an in-process vLLM (vLLM's single-process worker always opens cuda:0). The other GPUs stay
    visible so NCCL can still use NVLink peer-to-peer between the processes."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(visible[local:] + visible[:local]), "JAXPPO_LOCAL_DEVICE_IDS": "0"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    else:
        train_args = []
    p = argparse.ArgumentParser(prog="python -m jaxppo.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=0, help="processes on this host (default: one per GPU)")
    p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (default: this host, a free port)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--script", default=None, help="run this Python script in each process instead of jaxppo.train")
    p.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL when stopping")
    args = p.parse_args(argv)
    gpus = _gpu_count()
    nproc = args.nproc or gpus
    if nproc < 1:
        p.error("--nproc is required when no GPU is visible")
    if args.nnodes > 1 and args.coordinator is None:
        p.error("--coordinator HOST:PORT is required with --nnodes > 1")
    coordinator = args.coordinator or f"127.0.0.1:{_free_port()}"
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] \
        or [str(i) for i in range(gpus)]
    world = nproc * args.nnodes
    procs: list[subprocess.Popen] = []
    for local in range(nproc):
        rank = args.node_rank * nproc + local
        env = dict(os.environ, JAXPPO_COORDINATOR=coordinator, JAXPPO_NUM_PROCESSES=str(world),
                   JAXPPO_PROCESS_ID=str(rank), NCCL_NVLS_ENABLE="0")
        if gpus:
            env.update(gpu_env(local, visible))
        target = [args.script] if args.script else ["-m", "jaxppo.train"]
        procs.append(subprocess.Popen([sys.executable, *target, *train_args], env=env))
        print(f"jaxppo.launch: process {rank}/{world} pid {procs[-1].pid}", file=sys.stderr, flush=True)

    def forward(signum, frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)

    by_pid = {proc.pid: (i, proc) for i, proc in enumerate(procs)}
    failed: tuple[int, int] | None = None
    remaining = set(by_pid)
    while remaining:
        try:
            pid, status = os.waitpid(-1, 0)  # blocks until any child ends
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid not in remaining:
            continue
        remaining.discard(pid)
        i, proc = by_pid[pid]
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0 and failed is None:
            failed = (args.node_rank * nproc + i, proc.returncode)
            print(f"jaxppo.launch: process {failed[0]} exited with code {failed[1]}; stopping the other "
                  f"{len(remaining)}", file=sys.stderr, flush=True)
            _stop([by_pid[r][1] for r in remaining], args.grace)
    if failed is not None:
        code = failed[1]
        return code if code > 0 else 128 - code  # killed by a signal: 128 + signal number, like a shell
    return 0


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
