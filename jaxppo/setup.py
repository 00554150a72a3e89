"""What a run is built from: tokenizer, datasets (or the synthetic task), the model checkpoint
(or the embedded default's tiny random model, written as a real HF checkpoint so every engine loads it
through the same code)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxppo.config import Config
from jaxppo.data import PromptSpec, load_prompt_dataset, load_tokenizer
from jaxppo.data import synthetic
from jaxppo.distributed import barrier, is_main
from jaxppo.models import ModelConfig, build_model, init_params, save_hf_checkpoint

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def prepare_data(cfg: Config, run_dir: Path):
    """(tokenizer, tokenizer dir, train dataset, val dataset)."""
    d = cfg.data
    train_files, val_files = list(d.train_files), list(d.val_files)
    tok_dir = d.tokenizer or cfg.model.path
    if not train_files:
        task = synthetic.ArithmeticTask(d.synthetic_num_operands, d.synthetic_max_digits, d.synthetic_operators,
                                       instruction=d.synthetic_instruction)
        data_dir = run_dir / "data"
        if is_main() and not (data_dir / "train.parquet").is_file():
            synthetic.write_dataset(data_dir, task, train_size=d.synthetic_train_size, val_size=d.synthetic_val_size,
                                    seed=d.seed)
        train_files = [str(data_dir / "train.parquet")]
        val_files = val_files or [str(data_dir / "test.parquet")]
        if tok_dir is None:
            tok_dir = run_dir / "tokenizer"
            if is_main() and not (Path(tok_dir) / "tokenizer.json").is_file():
                synthetic.build_tokenizer(tok_dir, task, seed=d.seed)
        barrier("jaxppo-synthetic-data")  # process 0 wrote them; the others read them
    tokenizer = load_tokenizer(tok_dir)
    spec = PromptSpec(d.prompt_key, d.prompt_format, d.max_prompt_length, d.truncation)
    train = load_prompt_dataset(train_files, tokenizer, spec)
    val = load_prompt_dataset(val_files, tokenizer, spec) if val_files else None
    return tokenizer, Path(tok_dir), train, val


def tiny_model_config(cfg: Config, vocab_size: int, eos_token_id: int, pad_token_id: int) -> ModelConfig:
    m = cfg.model
    return ModelConfig(
        family="qwen2", vocab_size=vocab_size, hidden_size=m.tiny_hidden_size,
        intermediate_size=m.tiny_hidden_size * 3, num_hidden_layers=m.tiny_num_layers,
        num_attention_heads=m.tiny_num_heads, num_key_value_heads=max(1, m.tiny_num_heads // 2),
        head_dim=m.tiny_hidden_size // m.tiny_num_heads, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, attention_bias=True, max_position_embeddings=4096,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def prepare_model_dir(cfg: Config, run_dir: Path, tokenizer) -> Path:
    """The actor checkpoint: `model.path`, or the tiny default initialised from the seed and saved once."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    out = run_dir / "init_model"
    if is_main() and not (out / "config.json").is_file():
        mcfg = tiny_model_config(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        module = build_model(mcfg)
        params = init_params(module, jax.random.PRNGKey(cfg.trainer.seed))
        save_hf_checkpoint(params, mcfg, out)
    barrier("jaxppo-init-model")
    return out


def engine_dtype(cfg: Config) -> str:
    """Rollout weights: the compute dtype on accelerators; float32 on CPU (bf16 generation is slow there)."""
    return cfg.model.dtype if jax.default_backend() != "cpu" else "float32"


def attention_impl(cfg: Config) -> str | None:
    if cfg.model.attention_impl is not None:
        return cfg.model.attention_impl
    return "cudnn" if jax.default_backend() == "gpu" else None


__all__ = ["prepare_data", "prepare_model_dir", "tiny_model_config", "engine_dtype", "attention_impl", "DTYPES"]
