"""Model configuration: the subset of a Hugging Face `config.json` that a Qwen2 / Qwen3 / Llama decoder needs.

Reads both the old top-level `rope_theta` / `rope_scaling` keys (as published Qwen2.5 and Llama-3
checkpoints carry them) and transformers 5's `rope_parameters`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxppo.errors import CheckpointError

# HF `architectures` entry -> (family, head kind). "lm": causal LM head; "score": token-classification head.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen2ForCausalLM": ("qwen2", "lm"),
    "Qwen3ForCausalLM": ("qwen3", "lm"),
    "LlamaForCausalLM": ("llama", "lm"),
    "Qwen2ForTokenClassification": ("qwen2", "score"),
    "Qwen3ForTokenClassification": ("qwen3", "score"),
    "LlamaForTokenClassification": ("llama", "score"),
}
ARCHITECTURE = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only LM of the Qwen2 / Qwen3 / Llama family."""

    family: str  # "qwen2" | "qwen3" (RMSNorm on each head of q and k) | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always on for Qwen2; Llama and Qwen3: on o too)
    mlp_bias: bool = False
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    @property
    def architecture(self) -> str:
        return ARCHITECTURE[self.family]

    @property
    def qk_norm(self) -> bool:
        """Qwen3: an RMSNorm over head_dim on every query and key head, before RoPE."""
        return self.family == "qwen3"

    @property
    def o_bias(self) -> bool:
        """Llama's and Qwen3's attention_bias also puts a bias on o_proj; Qwen2's q/k/v bias does not."""
        return self.attention_bias and self.family in ("llama", "qwen3")

    def num_params(self, with_head: bool = True) -> int:
        """Parameter count (embedding included; a tied head counted once)."""
        d, f, h, kv, hd = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                           self.num_key_value_heads, self.head_dim)
        attn = d * h * hd * 2 + d * kv * hd * 2 + (h * hd + 2 * kv * hd if self.attention_bias else 0)
        attn += d if self.o_bias else 0
        attn += 2 * hd if self.qk_norm else 0
        layer = attn + 3 * d * f + 2 * d + (2 * f + d if self.mlp_bias else 0)
        head = 0 if (self.tie_word_embeddings or not with_head) else self.vocab_size * d
        return self.vocab_size * d + self.num_hidden_layers * layer + d + head

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2], float64, with the configured scaling applied."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if self.rope_type == "linear":
            inv = inv / self.rope_factor
        elif self.rope_type == "llama3":
            factor, lo, hi = self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor
            old = self.rope_original_max_position
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > old / lo, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
            inv = np.where(medium, smoothed, scaled)
        return inv

    def to_hf_dict(self, architecture: str | None = None, num_labels: int | None = None) -> dict[str, Any]:
        """A `config.json` body that transformers and vLLM load."""
        rope: dict[str, Any] = {"rope_type": self.rope_type}
        if self.rope_type != "default":
            rope["factor"] = self.rope_factor
        if self.rope_type == "llama3":
            rope.update(low_freq_factor=self.rope_low_freq_factor, high_freq_factor=self.rope_high_freq_factor,
                        original_max_position_embeddings=self.rope_original_max_position)
        out: dict[str, Any] = {
            "architectures": [architecture or self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_type == "default" else rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.family in ("llama", "qwen3"):
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = self.mlp_bias
        if num_labels is not None:
            out["num_labels"] = num_labels
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
        return out


def _rope_fields(raw: dict[str, Any], where: str) -> dict[str, Any]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: 'rope_parameters'/'rope_scaling' must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"{where}: rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type != "default":
        out["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max_position=int(params["original_max_position_embeddings"]))
    return out


def config_from_hf_dict(raw: dict[str, Any], where: str = "config.json") -> tuple[ModelConfig, str]:
    """Parse an HF config dict; returns the config and the head kind ("lm" or "score")."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs and model_type in ARCHITECTURE:
        arch = ARCHITECTURE[model_type]
    if arch is None:
        raise CheckpointError(
            f"{where}: unsupported architecture {archs or model_type!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    family, head = SUPPORTED_ARCHITECTURES[arch]
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("use_sliding_window", False):
        raise CheckpointError(f"{where}: use_sliding_window=true is not supported")
    try:
        heads = int(raw["num_attention_heads"])
        eos = raw.get("eos_token_id")
        cfg = ModelConfig(
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            # without the key: transformers' defaults (Qwen3Config 128, the others hidden / heads)
            head_dim=int(raw.get("head_dim") or (128 if family == "qwen3" else int(raw["hidden_size"]) // heads)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=True if family == "qwen2" else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=raw.get("pad_token_id"),
            **_rope_fields(raw, where),
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: missing required key {e.args[0]!r}") from None
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise CheckpointError(f"{where}: num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
                              f"num_key_value_heads ({cfg.num_key_value_heads})")
    return cfg, head


def load_config(model_dir: str | Path) -> tuple[ModelConfig, str]:
    """Read `<model_dir>/config.json`; a clear `CheckpointError` when it is missing or malformed."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json in {Path(model_dir)} (is this a Hugging Face model directory?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    return config_from_hf_dict(raw, where=str(path))
