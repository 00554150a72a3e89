"""Real architecture shapes (random weights: no checkpoint can be downloaded) for benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

from jaxppo.models import ModelConfig

_QWEN = dict(family="qwen2", vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=True,
             max_position_embeddings=32768, eos_token_id=151645, pad_token_id=151643, bos_token_id=151643)
_QWEN3 = dict(_QWEN, family="qwen3", attention_bias=False, head_dim=128, max_position_embeddings=40960)
SHAPES: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": ModelConfig(**_QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
    "qwen2.5-1.5b": ModelConfig(**_QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                num_attention_heads=12, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True),
    "qwen2.5-7b": ModelConfig(**_QWEN, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                              num_attention_heads=28, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False),
    # Qwen3 dense (q / k RMSNorm per head, no bias, head_dim 128 apart from hidden / heads)
    "qwen3-0.6b": ModelConfig(**_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": ModelConfig(**_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": ModelConfig(**_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": ModelConfig(**_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    # for CPU smoke tests of the benchmark scripts
    "tiny": ModelConfig(**{**_QWEN, "vocab_size": 512, "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 0}, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
    "tiny-qwen3": ModelConfig(**{**_QWEN3, "vocab_size": 512, "eos_token_id": 1, "pad_token_id": 0, "head_dim": 32,
                                 "bos_token_id": 0}, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False),
}


def write_config_dir(name: str, out: str | Path) -> Path:
    """A model directory with only config.json (engines load it with dummy weights, then get ours)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = SHAPES[name].to_hf_dict()
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
