"""Profiles written beside a step's (`trainer.profile_steps`): cProfile's text and stats, and the profile of one
call in a vLLM helper process (bridge/engines/vllm_processes.py), whose kernels and Python the trainer's profilers
do not see. scripts/trace_summary.py reads a step's directory with the helpers' traces in it."""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
from pathlib import Path
from typing import Iterator, Sequence


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


__all__ = ["profiled_call", "write_python_profile"]
