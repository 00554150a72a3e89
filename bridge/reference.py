"""Plain torch / transformers references for cross-framework comparison (written to be read, not fast)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu"):
    """The checkpoint as transformers loads it (causal LM or token classification), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    cfg = AutoConfig.from_pretrained(model_dir)
    is_score = any(a.endswith("ForTokenClassification") for a in (cfg.architectures or []))
    cls = AutoModelForTokenClassification if is_score else AutoModelForCausalLM
    model = cls.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype], attn_implementation="sdpa")
    return model.to(device).eval()


@torch.no_grad()
def hf_logits(model, input_ids: np.ndarray, attention_mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Float32 logits [b, t, vocab] (or [b, t, num_labels]) of a transformers model."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.as_tensor(input_ids, device=device),
                attention_mask=torch.as_tensor(attention_mask, device=device),
                position_ids=torch.as_tensor(positions, device=device))
    return out.logits.float().cpu().numpy()
