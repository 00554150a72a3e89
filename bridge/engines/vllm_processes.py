"""Several vLLM engines on one card, each in its own process (`rollout.engine_processes`): one generation call's
prompts split between them, so their host work (vLLM's scheduling and per-sequence bookkeeping, which bounds
generation at small model sizes: docs/benchmarks.md, "One batch's generation over several vLLM engines") runs side
by side instead of in one Python process.

The first engine is the trainer's in-process `VLLMEngine` (its weights pushed from DLPack views of the train state,
as with one engine); the others are helper processes (spawned, started one after another: each vLLM checks at start
that its share of the card is free), each running a `VLLMEngine` of its own. Their weights come from one shared copy
in the engines' dtype, allocated once in this process: CUDA tensors from torch's allocator, whose IPC handles the
helpers open once (CPU: tensors in shared memory). A push fills it from the pushed arrays (one cast copy on the
device), then every helper loads it into its own parameters (vLLM's `load_weights`) while this process goes on:
the trainer waits for a helper's load only at its next request (one step ahead, the next generation's; the next push
waits for it too, before it writes the copy again). XLA's buffers cannot be handed to another process directly (they
are not torch's allocations, and the update donates them), hence the copy; the memory plan counts it, with each
helper's weights, graphs and CUDA context (jaxppo/plan.py `vllm_fixed`).

With `in_trainer=False` (`rollout.engine_in_trainer=false`) every engine is a helper, even a single one: the trainer's
process then runs none of vLLM's host work (its scheduling, its threads that wait on the GPU), which otherwise shares
the trainer's interpreter with JAX's dispatch; the price is the shared copy and each helper's own weights and context.

A call's prompts go to the engines in contiguous chunks (as equal as they split); chunk i is sampled with the call's
seed + i, so the samples of a seeded call are reproducible for a given number of engines, not across numbers (one
helper alone samples as the trainer's own engine would: chunk 0, the call's seed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.multiprocessing as tmp

from bridge.dlpack import to_torch
from bridge.engines.vllm import VLLMEngine
from jaxppo.helper_signals import helper_signals
from jaxppo.models.hf_io import HFWeights
from jaxppo.models.lora import LoRAWeights
from jaxppo.profiling import profiled_call
from jaxppo.rollout import Rollouts, Sampling

log = logging.getLogger(__name__)
START_TIMEOUT_S = 1800.0  # a helper's vLLM start (a 7B shape's first start compiles for minutes)
CALL_TIMEOUT_S = 3600.0  # one generation, push, sleep or wake


@contextlib.contextmanager
def _helper_environment():
    """The environment a helper starts with (this process's own settings restored after): JAX_PLATFORMS=cpu, and
    the MPS priority the run gives its helpers (jaxppo.mps.helper_environment)."""
    from jaxppo import mps

    changes = {"JAX_PLATFORMS": "cpu", **mps.helper_environment()}
    before = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _serve(conn, model_dir: str, kwargs: dict[str, Any]) -> None:
    """A helper process: build the engine, then answer requests until "stop" (or the trainer's end)."""
    helper_signals()
    try:
        engine = VLLMEngine(model_dir, **kwargs)  # the shared copy (a list, HF names) goes to vLLM's load_weights
        helper_signals()  # again, after whatever vLLM's start installed
        conn.send(("ready", {"start_s": engine.start_s, "gpu": engine.gpu, "host_options": engine.host_options(),
                             "cudagraph_mode": engine.cudagraph_mode(),
                             "scheduler_limits": engine.scheduler_limits()}))
        shared: dict[str, torch.Tensor] = {}
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the trainer's end of the pipe closed: it has ended without saying stop
                return
            op = msg[0]
            if op == "stop":
                return
            if op == "shared":
                shared = msg[1]
                out = None
            elif op == "load":
                engine.update_weights(list(shared.items()))
                out = None
            elif op == "generate":  # with its wall and CPU seconds (this process's, all its threads)
                t0, c0 = time.perf_counter(), time.process_time()
                with profiled_call(*msg[3]):  # (None, ()) unless the trainer profiles this step
                    ro = engine.generate(msg[1], msg[2])
                out = ro, time.perf_counter() - t0, time.process_time() - c0
            elif op in ("sleep", "wake"):
                getattr(engine, op)()
                out = None
            else:
                raise ValueError(f"unknown request {op!r}")
            conn.send(("ok", out))
    except BaseException as e:  # noqa: BLE001 - the trainer raises it, naming this engine
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except (OSError, EOFError):
            pass
        raise


class VLLMProcesses:
    """`processes` vLLM engines on this process's card: this process's own and `processes - 1` helpers, or
    (`in_trainer=False`) `processes` helpers; each is started with `gpu_memory_utilization` (the share of one
    engine). Helpers are numbered from 1 in messages."""

    def __init__(self, model_dir: str | Path, *, processes: int, in_trainer: bool = True, **kwargs: Any):
        if processes < (2 if in_trainer else 1):
            raise ValueError(f"VLLMProcesses needs {2 if in_trainer else 1} or more engine processes, got {processes}")
        self.local = VLLMEngine(model_dir, **kwargs) if in_trainer else None
        self.start_s = self.local.start_s if self.local else 0.0
        self.pad_token_id = kwargs.get("pad_token_id", 0)
        self._dtype = getattr(torch, kwargs.get("dtype", "bfloat16"))
        self._info: dict[str, Any] = {}  # the first helper's engine, as it reported itself at its start
        self._protocol_state()
        ctx = tmp.get_context("spawn")  # a fresh interpreter: no CUDA or JAX state inherited
        try:
            for i in range(1, processes + (not in_trainer)):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(child, str(model_dir), kwargs), daemon=True,
                                   name=f"jaxppo-vllm-{i}")
                with _helper_environment():  # the child imports JAX before _serve runs (the weight types): on CPU
                    proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
                info = self._answer(i, "start", START_TIMEOUT_S)
                self._info = self._info or info
                self.start_s += info["start_s"]
        except BaseException:
            self.close()
            raise
        self.gpu = self.local.gpu if self.local else self._info["gpu"]
        log.info("vLLM: %d engines, each in its own process%s (%.1f s to start them)", processes,
                 "" if self.local else ", none in the trainer's", self.start_s)

    def _protocol_state(self) -> None:
        """What the exchanges with the helpers keep between calls (none started yet)."""
        self._conns, self._procs = [], []
        self._shared: dict[str, torch.Tensor] | None = None
        self._ended: set[int] = set()  # helpers known to have ended (after an error, or a closed pipe)
        self._last_call: dict[str, float] = {}  # the last generation's seconds per engine (`call_timings`)
        self._loading: set[int] = set()  # helpers whose answer to the last push is still to be read (`_answer`)
        self._profile: tuple[Path | None, tuple[str, ...]] = (None, ())  # `profile_calls`
        self._profiled_calls = 0

    @property
    def processes(self) -> int:
        return (self.local is not None) + len(self._conns)

    @property
    def _helpers(self) -> range:
        return range(1, len(self._conns) + 1)

    def _answer(self, i: int, what: str, timeout: float = CALL_TIMEOUT_S) -> Any:
        """Helper i's answer to `what`, after its answer to a push not yet read (a failed load is raised here)."""
        self._settle(i)
        return self._read(i, what, timeout)

    def _settle(self, i: int) -> None:
        """Read helper i's answer to the last push if not yet read (`update_weights` does not wait for it)."""
        if i in self._loading:
            self._loading.discard(i)
            self._read(i, "the weight push")

    def _read(self, i: int, what: str, timeout: float = CALL_TIMEOUT_S) -> Any:
        conn = self._conns[i - 1]
        try:
            if not conn.poll(timeout):
                raise RuntimeError(f"vLLM engine process {i}: no answer to {what} in {timeout:.0f} s")
            status, out = conn.recv()
        except (EOFError, OSError):  # its end of the pipe closed (a reset connection, or nothing more to read)
            self._ended.add(i)
            raise RuntimeError(f"vLLM engine process {i} ended during {what} (exit code {self._exit_code(i)})"
                               ) from None
        if status == "error":  # the helper ends after sending its error
            self._ended.add(i)
            raise RuntimeError(f"vLLM engine process {i}, {what}: {out}")
        return out

    def _send(self, i: int, *msg: Any) -> None:
        try:
            self._conns[i - 1].send(msg)
        except OSError:  # a broken pipe: the helper is gone
            self._ended.add(i)
            raise RuntimeError(f"vLLM engine process {i} has ended (exit code {self._exit_code(i)}); asked for "
                               f"{msg[0]}") from None

    def _exit_code(self, i: int) -> int | None:
        """Helper i's exit code, once it has ended (waited for a few seconds: its pipe closes just before)."""
        self._procs[i - 1].join(5)
        return self._procs[i - 1].exitcode

    def _all(self, op: str, *args: Any) -> None:
        """`op` in every helper at once and in this process's engine meanwhile. Sleep skips a helper that has ended:
        it comes on the way out of a failed call (`jaxppo.step.awake`), whose error is the one to see."""
        helpers = [i for i in self._helpers if not (op == "sleep" and i in self._ended)]
        for i in helpers:
            self._send(i, op, *args)
        if self.local:
            getattr(self.local, op)()
        for i in helpers:
            self._answer(i, op)

    # -------------------------------------------------------------- protocol

    def update_weights(self, named_arrays: Iterable[tuple[str, Any]]) -> None:
        """This process's engine as with one engine; the helpers from the shared copy, filled from the same arrays."""
        if self.local and not isinstance(named_arrays, (HFWeights, LoRAWeights)):
            named_arrays = list(named_arrays)  # iterated twice: the shared copy, then this process's engine
        for i in sorted(self._loading):  # the last push loaded everywhere before the shared copy is written again
            self._settle(i)
        shared, new = self._shared or {}, self._shared is None
        with torch.no_grad():
            for name, array in named_arrays:
                src = to_torch(array)
                if name not in shared or shared[name].shape != src.shape:  # the first push (or another layout)
                    dst = torch.empty(src.shape, dtype=self._dtype, device=src.device)
                    shared[name], new = (dst.share_memory_() if dst.device.type == "cpu" else dst), True
                shared[name].copy_(src)
                if self.gpu:  # before `array` goes: XLA may reuse a fresh array's memory once it is dropped (and
                    torch.cuda.current_stream().synchronize()  # the helpers read the copy from their own streams)
        if new:  # handed over once: the helpers keep it (CUDA: they open its IPC handles once)
            self._shared = shared
            for i in self._helpers:
                self._send(i, "shared", shared)
            for i in self._helpers:
                self._answer(i, "the shared weights")
        for i in self._helpers:  # each loads the copy into its engine beside this process's next work; its answer
            self._send(i, "load")  # is read before its next one (a request sent meanwhile queues behind the load)
        self._loading.update(self._helpers)
        if self.local:
            self.local.update_weights(named_arrays)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling) -> Rollouts:
        chunks = [[list(map(int, prompt_token_ids[j])) for j in c]
                  for c in np.array_split(np.arange(len(prompt_token_ids)), self.processes)]
        first = self.local is not None  # chunk j goes to helper j (+ 1 when chunk 0 is this process's)
        asked = [j for j in range(first, self.processes) if chunks[j]]  # fewer prompts than engines: some get none
        prof_dir, tools = self._profile
        n, self._profiled_calls = self._profiled_calls, self._profiled_calls + (prof_dir is not None)
        for j in asked:
            seeded = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + j)
            where = None if prof_dir is None else str(prof_dir / f"engine{j}_call{n}")
            self._send(j + 1 - first, "generate", chunks[j], seeded, (where, tools))
        t0, timings, parts = time.perf_counter(), {}, []
        if first and chunks[0]:
            parts.append(self.local.generate(chunks[0], sampling))
            timings["timing_s/gen_engine0"] = time.perf_counter() - t0
        for j in asked:
            out, wall, cpu = self._answer(j + 1 - first, "generate")
            parts.append(out)
            timings[f"timing_s/gen_engine{j}"], timings[f"perf/cpu_s/gen_engine{j}"] = wall, cpu
        self._last_call = timings
        return Rollouts.concat(parts, [len(c) for c in chunks if c], self.pad_token_id)

    def profile_calls(self, out: Path | None, tools: tuple[str, ...] = ()) -> None:
        """Until called with None: every helper profiles each generation it runs with `tools` (torch's profiler:
        `torch_trace.json`, its kernels on a GPU; `python`: cProfile), written to `out / engine<j>_call<n>` (chunk
        j's engine, the n-th call since). The trainer's profiled steps set it (`trainer.profile_steps`): the
        trainer's own profilers see none of a helper's work. This process's engine is in the trainer's profile."""
        self._profile, self._profiled_calls = (None if out is None else Path(out), tuple(tools)), 0

    def call_timings(self) -> dict[str, float]:
        """The last generation's seconds in each engine (chunk j's engine: `timing_s/gen_engine<j>`, wall from the
        call's start; a helper's own CPU seconds `perf/cpu_s/gen_engine<j>`): which engine the call waited for."""
        return dict(self._last_call)

    def sleep(self) -> None:
        self._all("sleep")

    def wake(self) -> None:
        self._all("wake")

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._conns, self._procs = [], []

    # what the benchmark scripts read of one engine: this process's, else the first helper's
    def host_options(self) -> dict[str, bool]:
        return self.local.host_options() if self.local else self._info["host_options"]

    def cudagraph_mode(self) -> str:
        return self.local.cudagraph_mode() if self.local else self._info["cudagraph_mode"]

    def scheduler_limits(self) -> dict[str, Any]:
        own = self.local.scheduler_limits() if self.local else self._info["scheduler_limits"]
        return {**own, "engine_processes": self.processes, "engine_in_trainer": self.local is not None}

