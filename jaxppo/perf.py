"""Throughput and MFU bookkeeping: FLOPs as computed, and the card's specified peak.

MFU here is model FLOPs over the card's *specified* dense peak (H100 / H200 SXM: 989 TFLOP/s in bf16),
the convention of the field (PaLM, Megatron), so figures compare across projects. FLOPs are counted as the
model computes them, not as a closed formula over padded shapes:
  - matmuls of the decoder layers: 6 x (their parameters) per token (forward 2, backward 4);
  - causal attention: scores and weighted values over the lower triangle only, per sequence of length S
    6 x layers x (heads x head_dim) x S^2 (half of PaLM's 12 x ... x S^2 for full attention);
  - the vocabulary head: 6 x hidden x vocab per *response* token (the only positions whose log-probs are
    taken); the critic's head is one row (negligible, counted as zero);
  - the embedding lookup and recomputation under remat are not counted (MFU, not HFU);
  - LoRA (frozen base): the base's weight gradients are never computed, so its matmuls and the head count
    4 x parameters per token (forward 2, input gradients 2), the adapters 6 x theirs.
Where the device's peak is not in the table (CPU, unknown cards) a measured matmul peak stands in.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.models.config import ModelConfig

# dense bf16 peak per device by `device_kind` (vendor datasheets; SXM parts)
SPEC_PEAK_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100": 989e12,
                   "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA B200": 2250e12}


@dataclasses.dataclass(frozen=True)
class FlopsModel:
    """FLOPs of one training pass (forward + backward) of a decoder."""

    per_token: float  # decoder-layer matmuls, per token
    attention: float  # per (sequence length)^2, causal
    head: float  # vocabulary head, per response token (0: value head)


def flops_model(cfg: ModelConfig, lm_head: bool = True, lora=None) -> FlopsModel:
    """`lora`: a jaxppo.models.lora.LoraSpec with rank > 0 when the base is frozen and adapters are trained."""
    from jaxppo.models.lora import adapter_params

    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size  # q, k, v, o; gate, up, down
    frozen = lora is not None and lora.rank > 0
    base = 4.0 if frozen else 6.0  # a frozen weight gets no gradient: forward + input gradients only
    adapters = 6.0 * adapter_params(cfg, lora) if frozen else 0.0
    return FlopsModel(per_token=base * cfg.num_hidden_layers * layer + adapters,
                      attention=6.0 * cfg.num_hidden_layers * q,
                      head=base * h * cfg.vocab_size if lm_head else 0.0)


def step_flops(model: FlopsModel, seq_lengths: np.ndarray, response_lengths: np.ndarray | None = None) -> float:
    """FLOPs of one training pass over sequences of `seq_lengths` tokens (prompt + response), the vocabulary
    head over `response_lengths` tokens each."""
    s = np.asarray(seq_lengths, np.float64)
    out = model.per_token * s.sum() + model.attention * float(np.square(s).sum())
    if response_lengths is not None:
        out += model.head * float(np.asarray(response_lengths, np.float64).sum())
    return out


def train_flops_per_token(cfg: ModelConfig, seq_len: int, response_len: int | None = None) -> float:
    """FLOPs per token of one training pass over sequences of `seq_len` tokens of which `response_len`
    (default: all) take log-probs: `step_flops` for one sequence, divided by its length."""
    m = flops_model(cfg)
    return step_flops(m, np.array([seq_len]), np.array([seq_len if response_len is None else response_len])) / seq_len


def device_peak_flops(device=None) -> tuple[float, str]:
    """(peak FLOP/s of one device, where it came from): the specified dense bf16 peak for known cards, else
    a measured matmul peak."""
    dev = device or jax.local_devices()[0]
    kind = getattr(dev, "device_kind", "")
    if kind in SPEC_PEAK_FLOPS:
        return SPEC_PEAK_FLOPS[kind], f"spec ({kind})"
    return measure_matmul_peak(), f"measured ({kind or dev.platform})"


def measure_matmul_peak(n: int | None = None, dtype=None, reps: int = 5) -> float:
    """Measured FLOP/s of one device on a square matmul (bf16 on accelerators, f32 on CPU)."""
    dev = jax.local_devices()[0]
    on_cpu = dev.platform == "cpu"
    n = n or (512 if on_cpu else 8192)
    dtype = dtype or (jnp.float32 if on_cpu else jnp.bfloat16)
    a = jax.device_put(jnp.ones((n, n), dtype), dev)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(a)
    out.block_until_ready()
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def involuntary_switches() -> int:
    """This process's involuntary context switches so far (its threads preempted while runnable: waiting for a
    CPU, not for I/O or a lock); 0 where `resource` is missing."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def steal_seconds() -> float | None:
    """CPU time this (virtual) machine's CPUs spent waiting for the hypervisor, summed over CPUs, from
    /proc/stat; None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class GCClock:
    """Wall time this process spends in Python's cyclic garbage collector (`gc.callbacks`), and collections
    by generation: `perf/gc_s` per step. A full collection walks every tracked object (the trainer's,
    JAX's, torch's and the engine's), so pauses inside generation show up as step-to-step noise there.
    One per process (`gc_clock()`)."""

    def __init__(self):
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.collections[info["generation"]] += 1


_GC_CLOCK: GCClock | None = None


def gc_clock() -> GCClock:
    """The process's GCClock, installed in `gc.callbacks` on first use."""
    import gc

    global _GC_CLOCK
    if _GC_CLOCK is None:
        _GC_CLOCK = GCClock()
        gc.callbacks.append(_GC_CLOCK)
    return _GC_CLOCK
