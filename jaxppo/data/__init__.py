"""Datasets (verl's parquet schema), tokenizers, batching and the resumable sampler."""

from __future__ import annotations

from pathlib import Path

from jaxppo.data.dataset import TRUNCATION_MODES, PromptDataset, PromptSpec, left_pad, load_prompt_dataset
from jaxppo.data.sampler import ResumableSampler, SamplerState
from jaxppo.errors import DataError

__all__ = ["TRUNCATION_MODES", "PromptDataset", "PromptSpec", "left_pad", "load_prompt_dataset",
           "ResumableSampler", "SamplerState", "load_tokenizer"]


def load_tokenizer(path: str | Path):
    """A Hugging Face tokenizer (chat template included) from a local directory, via `AutoTokenizer`."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path}: tokenizer directory not found")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot load a tokenizer ({e})") from None
    if tok.pad_token_id is None:  # Llama-style tokenizers: pad with EOS (prompts are masked anyway)
        tok.pad_token = tok.eos_token
    return tok
