"""What a run with offloaded states holds in this host's memory, planned before it starts (docs/memory.md).

The offloaded states (AdamW's moments, `jaxppo/offload.py`) live in XLA's pinned host allocator (`xla_gpu_host_bfc`),
a BFC allocator that grows by regions of pinned memory: the first 2 MiB, each next one twice the last, the last one
clipped at a cap, `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` (default 64; XLA's `GetGpuHostAllocator` and tsl's
`BFCAllocator::Extend`). A region is pinned whole, so what the host gives is the pool, not the arrays: on the H200,
57.7 GiB of arrays took 64.06 GiB of shared memory in 15 regions (2 MiB .. 32 GiB). An allocation past the cap fails
while the run runs ("Out of host memory"), so where the states need more than the default cap the plan raises it
(the variable is read as JAX starts on the GPU, in the training process after the plan's child: `memory.plan_in_child`);
a value the user set wins and is checked.

The process's own resident memory beside the pool (Python; the CUDA, XLA, torch and vLLM libraries and their
buffers) is nothing a compiler reports. Measured on the H200 by `scripts/host_memory.py` (smaps by mapping):
5.1 GiB for the 0.5B PPO config, 9.2 GiB for the 7B GRPO config, ~11.5 GiB for the 7B PPO with offload (its peak
resident 75.6 GiB less the 64.06 GiB pool). The plan reserves PROCESS_BYTES for it on a GPU: the largest of those
and 4 GiB, since what its largest part is (one anonymous block of 1.7-3.3 GiB from the engines' setup) is not known.
On CPU, where the pinned pool and those libraries' GPU buffers do not exist, it counts the states alone.
"""

from __future__ import annotations

import dataclasses
import math
import os

from jaxppo.errors import ConfigError

GiB = 2**30
CAP_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_CAP = 64 * GiB  # XLA's default for CAP_ENV
FIRST_REGION = 2 * 2**20  # BFCAllocator's first region with allow_growth: min(cap, 2 MiB)
CAP_HEADROOM = 1.05  # a raised cap: the states and a twentieth for the allocator's chunk rounding, + 1 GiB
PROCESS_BYTES = 16 * GiB  # the process beside the pool (measured 5.1-11.5 GiB, above); an allowance, not a compile
HOST_SHARE = 0.9  # the plan's host figure may take at most this share of the host's available RAM


def pinned_pool(in_use: int, cap: int) -> int | None:
    """The pinned pool XLA's host allocator grows to for `in_use` bytes of live arrays under `cap`: regions of
    2 MiB, 4 MiB, ... added until they hold `in_use`, the last clipped at the cap; None when the cap is reached
    first (the allocation would fail)."""
    total, region = 0, FIRST_REGION
    while total < in_use:
        if total >= cap:
            return None
        total += min(region, cap - total)
        region *= 2
    return total


def raised_cap(in_use: int) -> int:
    """The cap the plan sets where the default cannot hold `in_use` (whole GiB, as the variable is read)."""
    return max(DEFAULT_CAP, math.ceil(in_use * CAP_HEADROOM / GiB) * GiB + GiB)


def cap_in_force(in_use: int, can_raise: bool) -> tuple[int, str]:
    """The cap the run will have and where it comes from: the user's `CAP_ENV`; else XLA's default, raised to
    `raised_cap(in_use)` where that is too small and JAX has not started on the GPU yet (`can_raise`)."""
    if CAP_ENV in os.environ:
        return int(float(os.environ[CAP_ENV]) * GiB), f"{CAP_ENV}={os.environ[CAP_ENV]} in the environment"
    if pinned_pool(in_use, DEFAULT_CAP) is None and can_raise:
        cap = raised_cap(in_use)
        return cap, f"{CAP_ENV}={cap // GiB} (raised by the plan from XLA's default 64)"
    return DEFAULT_CAP, "XLA's default 64 GiB"


def set_cap(in_use: int) -> None:
    """Before JAX starts on the GPU: raise `CAP_ENV` where the default cannot hold `in_use` (a user's value wins)."""
    if in_use and CAP_ENV not in os.environ and pinned_pool(in_use, DEFAULT_CAP) is None:
        os.environ[CAP_ENV] = str(raised_cap(in_use) // GiB)


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """The host's share of a run (bytes, this host): the offloaded states, the pinned pool they take under the cap,
    the process's own allowance, and what the host has available (None: unknown, not checked)."""
    states: dict[str, int]
    cap: int
    cap_source: str
    pool: int | None  # None: the states do not fit under the cap
    available: int | None
    process: int = PROCESS_BYTES  # the process's own beside the pool (0 on CPU)

    @property
    def in_use(self) -> int:
        return sum(self.states.values())

    @property
    def peak(self) -> int:
        """The process's planned peak resident memory: the pool and the process's own."""
        return (self.pool or self.in_use) + self.process if self.in_use else 0

    def lines(self) -> list[str]:
        gb = lambda b: f"{b / GiB:8.2f} GiB" if b >= GiB else f"{b / 2**20:8.1f} MiB"  # noqa: E731
        out = ["  in host memory (offloaded; this host's share):"]
        out += [f"    {k:<40}{gb(v)}" for k, v in self.states.items()]
        pool = gb(self.pool) if self.pool is not None else "  exceeds"
        out.append(f"    {'XLA pinned pool they grow to':<40}{pool}  (regions doubling from 2 MiB; cap "
                   f"{self.cap / GiB:.0f} GiB: {self.cap_source})")
        if self.process:
            out.append(f"    {'the process itself (allowance)':<40}{gb(self.process)}  (Python, CUDA / torch / "
                       "vLLM; measured 5.1-11.5 GiB on the H200)")
        avail = f" of {self.available / GiB:.1f} GiB available" if self.available is not None else ""
        out.append(f"    {'host peak':<40}{gb(self.peak)}{avail}")
        return out

    def check(self) -> None:
        """ConfigError, naming what to change, when the states pass the pinned cap or the host's peak passes
        HOST_SHARE of its available RAM."""
        if not self.in_use:
            return
        parts = ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in self.states.items())
        fixes = ("use LoRA (actor.lora_rank / critic.lora_rank), offload fewer states "
                 "(actor.optimizer_offload / critic.optimizer_offload), or more hosts (docs/distributed.md)")
        if self.pool is None:
            raise ConfigError(f"the offloaded states ({parts}) need more pinned host memory than XLA's allocator may "
                              f"grow to ({self.cap / GiB:.0f} GiB: {self.cap_source}): set {CAP_ENV} to at least "
                              f"{raised_cap(self.in_use) // GiB} before JAX starts, or {fixes}")
        if self.available is not None and self.peak > HOST_SHARE * self.available:
            raise ConfigError(f"the run would hold {self.peak / GiB:.1f} GiB of host memory, more than "
                              f"{HOST_SHARE:.0%} of the {self.available / GiB:.1f} GiB this host has available "
                              f"(XLA's pinned pool {self.pool / GiB:.1f} GiB for the offloaded states: {parts}; the "
                              f"process itself {self.process / GiB:.0f} GiB): {fixes}")


def host_available() -> int | None:
    """This host's available RAM (/proc/meminfo's MemAvailable; elsewhere None: not checked)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan_host(states: dict[str, int], available: int | None = None) -> HostPlan:
    """The host plan for offloaded `states` (bytes on this host, by component); `available`: the host's RAM to count
    against (None: this host's MemAvailable). The cap may be raised only while JAX has not started on the GPU here,
    or in the plan's child (its parent raises it before starting JAX)."""
    import jax
    from jax._src import xla_bridge

    in_use = sum(states.values())
    can_raise = os.environ.get("JAXPPO_PLAN_CHILD") == "1" or not xla_bridge.backends_are_initialized()
    cap, source = cap_in_force(in_use, can_raise)
    return HostPlan(dict(states), cap, source, pinned_pool(in_use, cap) if in_use else 0,
                    host_available() if available is None else available,
                    PROCESS_BYTES if jax.default_backend() == "gpu" else 0)
