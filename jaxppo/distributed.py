"""Several processes, one global mesh: `jax.distributed` set up from the environment, and the few
host-side collectives the trainer needs (gather rows for metrics, agree on a stop).

The environment is jaxppo's own (`python -m jaxppo.launch` sets JAXPPO_COORDINATOR,
JAXPPO_NUM_PROCESSES, JAXPPO_PROCESS_ID, JAXPPO_LOCAL_DEVICE_IDS), torchrun's (MASTER_ADDR,
MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK) or SLURM's (SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID, with
MASTER_ADDR / MASTER_PORT or JAXPPO_COORDINATOR for the coordinator). One process: nothing to do.

Which GPU a process uses: its own GPU is listed first in CUDA_VISIBLE_DEVICES and every framework takes
device 0 (JAX through local_device_ids=(0,), torch and an in-process vLLM, whose single-process worker
always opens cuda:0). `jaxppo.launch` sets that up; under torchrun or SLURM, `initialize_from_env` moves the
GPU of the rank's local index (LOCAL_RANK / SLURM_LOCALID) to the front of CUDA_VISIBLE_DEVICES itself,
before any framework touches a GPU, so the launcher's environment needs no change. The other GPUs stay
visible, so NCCL can still use NVLink between the processes.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np


@dataclasses.dataclass(frozen=True)
class Topology:
    coordinator: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None


def topology_from_env(env: dict[str, str] | None = None) -> Topology | None:
    env = dict(os.environ if env is None else env)

    def ids(value):
        return tuple(int(x) for x in value.split(",")) if value else None

    if "JAXPPO_NUM_PROCESSES" in env:
        return Topology(env["JAXPPO_COORDINATOR"], int(env["JAXPPO_NUM_PROCESSES"]), int(env["JAXPPO_PROCESS_ID"]),
                        ids(env.get("JAXPPO_LOCAL_DEVICE_IDS")))
    coord = env.get("JAXPPO_COORDINATOR") or (
        f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" if "MASTER_ADDR" in env and "MASTER_PORT" in env else None)
    if "WORLD_SIZE" in env and "RANK" in env and coord:  # torchrun
        local = env.get("LOCAL_RANK")
        return Topology(coord, int(env["WORLD_SIZE"]), int(env["RANK"]), (0,) if local else None)
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and coord:
        local = env.get("SLURM_LOCALID")
        return Topology(coord, int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]), (0,) if local else None)
    return None


def own_gpu_first(env: dict[str, str] | None = None) -> str | None:
    """CUDA_VISIBLE_DEVICES with this rank's GPU (index LOCAL_RANK / SLURM_LOCALID of the visible list) first,
    for torchrun / SLURM ranks; None where there is nothing to reorder (jaxppo.launch already did, one process,
    or no GPU)."""
    env = dict(os.environ if env is None else env)
    if "JAXPPO_NUM_PROCESSES" in env:
        return None
    local = env.get("LOCAL_RANK") if "WORLD_SIZE" in env else env.get("SLURM_LOCALID")
    if local is None:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        from jaxppo.launch import _gpu_count

        visible = ",".join(str(i) for i in range(_gpu_count()))
    ids = [d.strip() for d in visible.split(",") if d.strip()]
    i = int(local)
    if not ids or i >= len(ids):
        return None
    return ",".join(ids[i:] + ids[:i])


def initialize_from_env() -> Topology | None:
    """`jax.distributed.initialize` when the environment describes several processes (before any other
    JAX call). CPU collectives go through gloo; on GPUs, NCCL (keep NCCL_NVLS_ENABLE=0, see the launcher).
    With `JAX_PLATFORMS=cpu` the local device ids are not passed (CPU devices are not per-process GPUs).
    `JAXPPO_HEARTBEAT_TIMEOUT_S` (default JAX's 100): how long a process may go without a heartbeat before the
    coordination service ends every process; a host whose CPUs are oversubscribed (a CI machine running other
    work beside the processes) can starve the heartbeat threads that long."""
    topo = topology_from_env()
    if topo is None or topo.num_processes <= 1:
        return None
    if os.environ.get("JAX_PLATFORMS", "") != "cpu":
        order = own_gpu_first()
        if order is not None:  # before any framework initialises CUDA (it reads the variable then)
            os.environ["CUDA_VISIBLE_DEVICES"] = order
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    cpu = os.environ.get("JAX_PLATFORMS", "") == "cpu"
    jax.distributed.initialize(coordinator_address=topo.coordinator, num_processes=topo.num_processes,
                               process_id=topo.process_id,
                               local_device_ids=None if cpu else (list(topo.local_device_ids)
                                                                  if topo.local_device_ids else None),
                               heartbeat_timeout_seconds=int(os.environ.get("JAXPPO_HEARTBEAT_TIMEOUT_S", "100")))
    return topo


def process_count() -> int:
    import jax

    return jax.process_count()


def process_index() -> int:
    import jax

    return jax.process_index()


def share(n: int, what: str = "items") -> slice:
    """This process's contiguous share of n items (n must split evenly)."""
    import jax

    k, p = jax.process_count(), jax.process_index()
    if n % k:
        raise ValueError(f"{n} {what} do not split evenly over {k} processes")
    return slice(p * n // k, (p + 1) * n // k)


def gather_rows(x: np.ndarray) -> np.ndarray:
    """Every process's rows of `x` (same shape on each), concatenated in process order."""
    if process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))


def gather_ragged(x: np.ndarray, fill) -> np.ndarray:
    """Like `gather_rows` for 1-D arrays whose length differs by process (`fill` marks the padding)."""
    if process_count() == 1:
        return np.asarray(x)
    n = int(gather_rows(np.array([len(x)])).max())
    padded = np.full((n,), fill, np.asarray(x).dtype)
    padded[: len(x)] = x
    out = gather_rows(padded)
    return out[out != fill] if not (isinstance(fill, float) and np.isnan(fill)) else out[~np.isnan(out)]


def gather_objects(obj) -> list:
    """Every process's JSON-serialisable `obj`, in process order (a collective: all processes must call it)."""
    import json

    if process_count() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = gather_rows(np.array([len(data)]))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: len(data)] = data
    rows = gather_rows(padded[None])
    return [json.loads(bytes(r[:n]).decode()) for r, n in zip(rows, sizes)]


def local_rows(x, axis: int = 0) -> np.ndarray:
    """This process's part of a global array sharded over its batch axis `axis` (what it contributed)."""
    if process_count() == 1:
        return np.asarray(x)
    pieces = {}
    for s in x.addressable_shards:
        start = s.index[axis].start or 0
        pieces.setdefault(start, np.asarray(s.data))
    return np.concatenate([pieces[k] for k in sorted(pieces)], axis=axis)


def is_main() -> bool:
    import jax

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait for every process (no-op with one): e.g. after process 0 wrote a file the others read."""
    if process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any (a collective: all processes must call it)."""
    if process_count() == 1:
        return bool(flag)
    return bool(gather_rows(np.array([int(flag)])).any())


__all__ = ["Topology", "topology_from_env", "own_gpu_first", "initialize_from_env", "share", "gather_rows", "gather_ragged",
           "gather_objects",
           "local_rows", "any_process", "process_count", "process_index", "is_main", "barrier"]
