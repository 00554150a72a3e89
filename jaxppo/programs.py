"""The step's jitted programs, compiled ahead of time and kept.

The memory plan (`jaxppo/plan.py`) compiles each program of the step for the run's real shapes and shardings from
abstract arguments (`jax.ShapeDtypeStruct`s carrying their shardings) before any state exists, and reads what XLA
will need from `compiled.memory_analysis()`. A `Program` keeps those executables and calls them directly when the
run's arguments arrive with the same signature: jax.jit would compile the same program again (its dispatch cache
and the ahead-of-time path are separate), so a start compiles each program once. An argument signature not seen
before compiles through the same path, and `compiles()` counts every executable (the `perf/compiles` metric).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np


def _leaf_key(x: Any) -> tuple:
    return (tuple(np.shape(x)), np.dtype(x.dtype).name, bool(getattr(x, "weak_type", False)),
            getattr(x, "sharding", None))


@dataclasses.dataclass(frozen=True)
class Memory:
    """What XLA reports for one compiled program, in bytes per device."""

    arguments: int
    outputs: int
    aliases: int  # outputs written into donated arguments (counted in both above)
    temps: int
    code: int

    @classmethod
    def of(cls, compiled: Any) -> "Memory":
        m = compiled.memory_analysis()
        if m is None:  # a backend without the analysis
            return cls(0, 0, 0, 0, 0)
        return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
                   int(m.temp_size_in_bytes), int(m.generated_code_size_in_bytes))

    def beside(self, resident_arguments: int) -> int:
        """What the program adds to the device while it runs, beside `resident_arguments` bytes of its arguments
        that live on the device anyway (the run's states): its other arguments (the batch), its temporaries,
        and its outputs that do not overwrite a donated argument."""
        return max(self.arguments - resident_arguments, 0) + self.temps + max(self.outputs - self.aliases, 0) \
            + self.code


# a GPU probe's compile (see Program.probe)
PROBE_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_disable_hlo_passes": "rematerialization"}


class Program:
    """A jitted function whose executables are compiled from abstract or concrete arguments and kept, then called
    directly. Static arguments are part of the signature and are not passed to the executable."""

    def __init__(self, fn: Callable, *, name: str = "", static_argnums: Sequence[int] = (),
                 donate_argnums: Sequence[int] = (), out_shardings: Any = None, keep_unused: bool = False):
        # keep_unused: arguments the function does not read stay the executable's (XLA's memory counts them)
        kw = dict(static_argnums=tuple(static_argnums), donate_argnums=tuple(donate_argnums), keep_unused=keep_unused)
        if out_shardings is not None:
            kw["out_shardings"] = out_shardings

        def program(*args):
            return fn(*args)

        # the name XLA's compile events and profiles carry: jit(jaxppo_<name>)
        program.__name__ = program.__qualname__ = "jaxppo_" + "".join(c if c.isalnum() else "_" for c in name)
        self.jitted = jax.jit(program, **kw)
        self.name = name
        self.static = frozenset(static_argnums)
        self.executables: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        # called with (this program, the new executable, what differs from the ones compiled before) for each
        # compile once the run has started (`jaxppo.plan.watch_late_compiles`): a signature the plan did not see
        self.late: Callable[["Program", Any, str], None] | None = None

    def signature(self, args: Sequence[Any]) -> tuple:
        static = tuple(args[i] for i in sorted(self.static))
        leaves, tree = jax.tree.flatten([a for i, a in enumerate(args) if i not in self.static])
        return static, tree, tuple(_leaf_key(x) for x in leaves)

    def compile(self, *args: Any) -> Any:
        """The executable for these arguments (abstract or concrete), compiled once per signature. Call inside the
        mesh and logical-axis-rules context the function traces under."""
        key = self.signature(args)
        with self._lock:
            exe = self.executables.get(key)
            if exe is None:
                before = list(self.executables)
                exe = self.jitted.lower(*args).compile()
                self.executables[key] = exe
                if self.late is not None:
                    self.late(self, exe, difference(key, before))
        return exe

    def memory(self, *args: Any) -> Memory:
        return Memory.of(self.compile(*args))

    def probe(self, *args: Any) -> Memory:
        """XLA's memory for these arguments: what the budget search asks of each rung. In the child process that
        plans a GPU run (JAXPPO_PROBE_WITHOUT_AUTOTUNE=1, `jaxppo.memory.plan_in_child`), from a compile that is
        not kept, with autotuning off (the kernels' choice barely moves the buffers, and autotuning is most of a
        large program's compile time) and without XLA's rematerialization: that pass runs only for a program over
        the device's memory, where it spent minutes per 7B rung failing to bring it under (seen on an H200), so a
        rung over it is refused at its plain size, and at a rung under it the run compiles the same program;
        elsewhere the program itself, compiled and kept."""
        import os

        if jax.default_backend() != "gpu" or os.environ.get("JAXPPO_PROBE_WITHOUT_AUTOTUNE") != "1":
            return self.memory(*args)  # the probe is the program the run calls: compiled once, kept
        return Memory.of(self.jitted.lower(*args).compile(compiler_options=PROBE_OPTIONS))

    def __call__(self, *args: Any) -> Any:
        exe = self.compile(*args)
        return exe(*[a for i, a in enumerate(args) if i not in self.static])

    def compiles(self) -> int:
        return len(self.executables)


def difference(key: tuple, before: list[tuple]) -> str:
    """What sets signature `key` apart from the nearest of `before` (Program.signature's): the static arguments,
    the tree, or the leaves (by position: shape, dtype, weak type, sharding) that differ."""
    if not before:
        return "the first compile of this program"
    static, tree, leaves = key
    best = None
    for s, t, ls in before:
        diff = [f"static arguments {s!r} -> {static!r}"] if s != static else []
        if t != tree or len(ls) != len(leaves):
            diff.append("a different argument tree")
        else:
            diff += [f"leaf {i}: {old[:3]} -> {new[:3]}" + (" (sharding)" if old[3] != new[3] else "")
                     for i, (old, new) in enumerate(zip(ls, leaves)) if old != new]
        if best is None or len(diff) < len(best):
            best = diff
    return "; ".join(best[:6]) + (f" (+{len(best) - 6} more)" if len(best) > 6 else "")


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a tree of arrays or ShapeDtypeStructs."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


def device_bytes(tree: Any, device: Any = None) -> int:
    """Bytes of `tree`'s arrays (or ShapeDtypeStructs with shardings) on one device (default: the first local one):
    each leaf's shard there, by its sharding's shard shape."""
    from jaxppo.offload import is_host

    device = device or jax.local_devices()[0]
    total = 0
    for x in jax.tree.leaves(tree):
        if is_host(x):  # offloaded to host memory (jaxppo/offload.py): not the device's
            continue
        sharding = getattr(x, "sharding", None)
        shape = np.shape(x)
        if sharding is not None:
            if device not in sharding.device_set:
                continue
            shape = sharding.shard_shape(shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


__all__ = ["Program", "Memory", "abstract", "device_bytes"]
