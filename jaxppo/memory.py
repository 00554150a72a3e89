"""The GPU memory plan: one knob (`rollout.gpu_memory_utilization`) splits the card between vLLM and JAX.

vLLM takes `u` of the card's memory for weights + KV cache and checks at start that it is free; JAX is
capped at `1 - u - margin` (`XLA_PYTHON_CLIENT_MEM_FRACTION`, allocated on demand rather than up front,
`XLA_PYTHON_CLIENT_PREALLOCATE=false`), so the two never compete, whatever order they grow in. vLLM
sleeps while JAX trains (KV cache freed, weights dropped: level 2) and wakes for generation. These
variables must be set before JAX initialises its GPU backend, which is why `jaxppo.train` applies the
plan before anything touches a device.
"""

from __future__ import annotations

import os

MARGIN = 0.05  # CUDA context, cuBLAS / cuDNN workspaces, NCCL buffers, fragmentation


def plan(gpu_memory_utilization: float) -> dict[str, str]:
    """Environment for JAX given vLLM's share of the card."""
    if not 0.0 < gpu_memory_utilization < 1.0 - MARGIN:
        raise ValueError(f"rollout.gpu_memory_utilization must be in (0, {1 - MARGIN}), got {gpu_memory_utilization}")
    jax_share = 1.0 - gpu_memory_utilization - MARGIN
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{jax_share:.3f}"}


def apply(gpu_memory_utilization: float) -> dict[str, str]:
    """Set the plan's variables (those the user set explicitly win) and return what is in force."""
    env = plan(gpu_memory_utilization)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in env}


def describe(gpu_memory_utilization: float, jax_limit_bytes: int | None) -> str:
    """One line for the log; `jax_limit_bytes` is JAX's `bytes_limit` (its fraction of the card)."""
    jax_frac = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    total_bytes = jax_limit_bytes / jax_frac if jax_limit_bytes else None
    if total_bytes:
        gb = total_bytes / 2**30
        return (f"GPU memory plan: {gb:.0f} GiB card; vLLM {gpu_memory_utilization:.2f} = "
                f"{gb * gpu_memory_utilization:.1f} GiB (weights + KV cache, asleep during training); "
                f"JAX up to {jax_frac:.2f} = {gb * jax_frac:.1f} GiB (on demand)")
    return f"GPU memory plan: vLLM {gpu_memory_utilization:.2f} of the card, JAX up to {jax_frac:.2f}"
