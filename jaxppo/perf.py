"""Throughput and MFU bookkeeping: FLOPs per token and a measured matmul peak per device."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxppo.models.config import ModelConfig


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 N (forward + backward matmuls, embedding lookup excluded) + attention 12 * L * d_attn * seq (PaLM's)."""
    n = cfg.num_params(with_head=True) - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len
    return 6.0 * n + attn


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
