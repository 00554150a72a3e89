"""Profiles of a training step (`trainer.profile_steps`): JAX's trace, torch's profiler and cProfile around the
step, and the profile of one call in a vLLM helper process (bridge/engines/vllm_processes.py), whose kernels and
Python the trainer's profilers do not see. scripts/trace_summary.py reads a step's directory with the helpers'
traces in it."""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence


def write_python_profile(prof: cProfile.Profile, out: Path, top: int = 40) -> None:
    """cProfile's record: `python_profile.pstats` (python -m pstats, snakeviz) and `python_profile.txt`, the `top`
    functions by their own time and by their time in all."""
    prof.dump_stats(str(out / "python_profile.pstats"))
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        text.write(f"== by {key}\n")
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(top)
    (out / "python_profile.txt").write_text(text.getvalue())


@contextlib.contextmanager
def profiled_call(out: str | Path | None, tools: Sequence[str]) -> Iterator[None]:
    """The enclosed call under torch's profiler (`torch` in `tools`: CPU ops, and on a GPU every kernel of this
    process through CUPTI; `torch_trace.json`) and cProfile (`python`), written to `out`; nothing when `out` is
    None or no tool applies."""
    if out is None or not {"torch", "python"} & set(tools):
        yield
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch_prof = py_prof = None
    if "torch" in tools:
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch_prof = torch.profiler.profile(activities=acts)
    if "python" in tools:
        py_prof = cProfile.Profile()
    try:
        with contextlib.ExitStack() as stack:
            if torch_prof is not None:
                stack.enter_context(torch_prof)
            if py_prof is not None:
                py_prof.enable()
                stack.callback(py_prof.disable)
            yield
    finally:
        if torch_prof is not None:
            torch_prof.export_chrome_trace(str(out / "torch_trace.json"))
        if py_prof is not None:
            write_python_profile(py_prof, out)


@contextlib.contextmanager
def profiled_step(out: Path, tools: Sequence[str], helpers: Callable[[Path | None, tuple[str, ...]], None] | None
                  ) -> Iterator[None]:
    """The enclosed step under the profilers `tools` names (trainer.profile_tools), written to `out`: JAX's trace
    (TensorBoard / Perfetto), torch's (the rollout engine; on a GPU every kernel of the process) only where torch
    is loaded, both with the same region names, and cProfile of this thread (innermost: the other profilers' own
    start and stop are not in it), as in the helpers' profiles. `helpers` (`VLLMProcesses.profile_calls`, or None):
    told to profile each generation of the step with the same tools (`engine<j>_call<n>/`), and to stop after."""
    import jax

    out.mkdir(parents=True, exist_ok=True)
    local = tuple(x for x in tools if x != "torch" or "torch" in sys.modules)
    if helpers is not None:
        helpers(out, tuple(tools))
    try:
        with contextlib.ExitStack() as stack:
            if "jax" in tools:
                opts = jax.profiler.ProfileOptions()
                opts.python_tracer_level = 0  # Python call tracing floods the trace (and caps it), no phase in it
                stack.enter_context(jax.profiler.trace(str(out), create_perfetto_trace=True, profiler_options=opts))
            stack.enter_context(profiled_call(out, local))
            yield
    finally:
        if helpers is not None:
            helpers(None, ())


__all__ = ["profiled_call", "profiled_step", "write_python_profile"]
