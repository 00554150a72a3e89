"""Builders for tiny Hugging Face checkpoints (random init, `save_pretrained`) used across the tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,  # head_dim 32: vLLM CPU needs it
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
            initializer_range=0.2, rms_norm_eps=1e-6)


def make_hf_checkpoint(out: Path, family: str = "qwen2", *, tie: bool = False, rope_scaling: dict | None = None,
                       head: str = "lm", seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Save a random-init transformers model of `family` ('qwen2' | 'qwen3' | 'llama') to `out`; returns `out`."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification, Qwen2Config,
                              Qwen2ForCausalLM, Qwen2ForTokenClassification, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3ForTokenClassification)

    torch.manual_seed(seed)
    kw = dict(TINY, tie_word_embeddings=tie, **overrides)
    if family == "qwen2":
        cfg = Qwen2Config(**kw)
        cls = Qwen2ForCausalLM if head == "lm" else Qwen2ForTokenClassification
    elif family == "qwen3":  # head_dim set apart from hidden / heads, as Qwen3's configs do
        cfg = Qwen3Config(**dict(dict(head_dim=32), **kw))
        cls = Qwen3ForCausalLM if head == "lm" else Qwen3ForTokenClassification
    elif family == "llama":
        if rope_scaling is not None:
            kw["rope_scaling"] = rope_scaling
        cfg = LlamaConfig(**kw)
        cls = LlamaForCausalLM if head == "lm" else LlamaForTokenClassification
    else:
        raise ValueError(family)
    if head == "score":
        cfg.num_labels = 1
    model = cls(cfg)
    with torch.no_grad():  # HF zero-inits biases; random ones make the bias path observable
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return Path(out)


def left_padded_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int):
    """Ids, mask with left padding (row 0 unpadded, others random), HF-style positions."""
    from jaxppo.compare import random_left_padded_batch

    ids, mask, pos = random_left_padded_batch(rng, batch, seq, vocab)
    mask[0] = 1
    return ids, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0)
