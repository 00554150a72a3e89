"""What a run is built from: tokenizer, datasets (or the synthetic task), the model checkpoint
(or the embedded default's tiny random model, written as a real HF checkpoint so every engine loads it
through the same code)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxppo.config import Config
from jaxppo.errors import ConfigError, DataError
from jaxppo.data import PromptSpec, load_prompt_dataset, load_tokenizer
from jaxppo.data import synthetic
from jaxppo.distributed import barrier, is_main
from jaxppo.models import ModelConfig, build_model, init_params, save_hf_checkpoint

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


RUN_LOCK = ".jaxppo.lock"  # in the run directory: held by the process training there


def lock_run_dir(run_dir: Path):
    """Hold the run directory for this process (a POSIX lock on RUN/.jaxppo.lock, released when the process ends,
    however it ends): a second process started on the same directory (the same command twice, a scheduler's requeue
    while the first still runs) would interleave its metrics and checkpoints with the first's. Refused with a
    ConfigError naming the holder; the same process may lock it again (trainers re-created in one process). Returns
    the open lock file, to keep while the run lasts (closing it releases the lock)."""
    import datetime
    import errno
    import fcntl
    import logging
    import socket

    f = open(Path(run_dir) / RUN_LOCK, "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):  # a filesystem without locks (some NFS mounts): go on
            logging.getLogger(__name__).warning("%s: cannot lock (%s); nothing stops a second process from training "
                                                "in this directory at the same time", run_dir, e.strerror or e)
            return f
        f.seek(0)
        holder = f.read().strip() or "a process that did not say which"
        f.close()
        raise ConfigError(f"trainer.default_local_dir: {run_dir} is in use by a running jaxppo process ({holder}); "
                          "wait for it to end or stop it, or choose another directory") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {datetime.datetime.now():%Y-%m-%d %H:%M:%S}\n")
    f.flush()
    return f


def make_run_dir(cfg: Config) -> Path:
    """`trainer.default_local_dir`, created if needed; a path that is a file or cannot be written is a ConfigError."""
    run_dir = Path(cfg.trainer.default_local_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"trainer.default_local_dir: {run_dir} is a file, not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"trainer.default_local_dir: cannot create {run_dir} ({e.strerror or e})") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"trainer.default_local_dir: {run_dir} is not writable")
    return run_dir


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed over it: a reader sees the old or the new file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the records of `metrics.jsonl` past the step a run resumes at, so a resumed run logs each step once: a
    step's line is written before its checkpoint, so a kill between them (or during a save) left lines that the
    resumed run writes again. From step 0 (no checkpoint) every line goes: the run starts over."""
    path = Path(path)
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            rec_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a kill
        if rec_step < step or (rec_step == step and step > 0):
            keep.append(line if line.endswith("\n") else line + "\n")
    if len(keep) != len(lines):
        write_atomic(path, "".join(keep))


def prepare_data(cfg: Config, run_dir: Path):
    """(tokenizer, tokenizer dir, train dataset, val dataset)."""
    d = cfg.data
    train_files, val_files = list(d.train_files), list(d.val_files)
    tok_dir = d.tokenizer or cfg.model.path
    if not train_files:
        task = synthetic.ArithmeticTask(d.synthetic_num_operands, d.synthetic_max_digits, d.synthetic_operators,
                                       instruction=d.synthetic_instruction)
        data_dir = run_dir / "data"
        if is_main():
            _write_or_check_synthetic(data_dir, task, d)
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
    per_step = d.gen_batch_size if (cfg.algorithm.filter_groups.enable and d.gen_batch_size) else d.train_batch_size
    if len(train) < per_step:
        filtered = f" ({train.num_filtered} more were longer than data.max_prompt_length)" if train.num_filtered else ""
        raise DataError(f"{', '.join(train.files)}: {len(train)} prompts{filtered}, fewer than the "
                        f"{per_step} a step draws (data.{'gen' if per_step != d.train_batch_size else 'train'}"
                        "_batch_size): lower it or add data")
    check_reward_sources(cfg, [ds for ds in (train, val) if ds is not None])
    return tokenizer, Path(tok_dir), train, val


def check_reward_sources(cfg: Config, datasets) -> None:
    """Every row's `data_source` has a reward: a registered rule, `reward.default_rule`, or the user's function.
    An unknown source is an error naming the files, the sources and the known ones (a typo like "gsm8k" for
    "openai/gsm8k" would otherwise score every response with another rule)."""
    if cfg.custom_reward_function.path or cfg.reward.default_rule:
        return
    from jaxppo.rewards.registry import PREFIXES, REWARD_FUNCTIONS, rule_for

    known = [k for k in REWARD_FUNCTIONS.names() if k != "default"] + [f"{p}*" for p in PREFIXES]
    for ds in datasets:
        unknown = sorted({s for s in ds.data_source if rule_for(s) is None})
        if unknown:
            raise DataError(f"{', '.join(ds.files)}: no reward rule for data_source {unknown}; known: {known}. Set "
                            "reward.default_rule to one of them, or custom_reward_function.path to your own")


_SYNTHETIC_KEYS = ("synthetic_train_size", "synthetic_val_size", "synthetic_num_operands", "synthetic_max_digits",
                   "synthetic_operators", "synthetic_instruction", "seed")


def _write_or_check_synthetic(data_dir: Path, task, d) -> None:
    """The synthetic task's parquet files, written once per run directory with the settings they were made from
    (`data/synthetic.json`); a run directory whose data was made with other settings is an error, not reused."""
    want = {k: getattr(d, k) for k in _SYNTHETIC_KEYS}
    record = data_dir / "synthetic.json"
    if (data_dir / "train.parquet").is_file():
        if record.is_file():
            have = json.loads(record.read_text())
            diff = [f"data.{k}={have.get(k)!r} there, {want[k]!r} now" for k in want if have.get(k) != want[k]]
            if diff:
                raise ConfigError(f"{data_dir}: this run directory's synthetic data was made with other settings "
                                  f"({'; '.join(diff)}): use another trainer.default_local_dir or the run's settings")
        return
    synthetic.write_dataset(data_dir, task, train_size=d.synthetic_train_size, val_size=d.synthetic_val_size,
                            seed=d.seed)
    write_atomic(record, json.dumps(want, indent=2) + "\n")


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
    """The actor checkpoint: `model.path`, or the tiny default initialised from the seed and saved once (a run
    directory whose tiny model has another shape than `model.tiny_*` asks is an error, not silently reused)."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    out = run_dir / "init_model"
    mcfg = tiny_model_config(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    if is_main():
        if (out / "config.json").is_file():
            _check_tiny(out, mcfg)
        else:
            module = build_model(mcfg)
            params = init_params(module, jax.random.PRNGKey(cfg.trainer.seed))
            # to the host at once: the export then slices the layers there, not in a program per tensor shape
            save_hf_checkpoint(jax.device_get(params), mcfg, out)
    barrier("jaxppo-init-model")
    return out


SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size")


def shape_differences(have: ModelConfig, want: ModelConfig) -> list[str]:
    return [f"{k}={getattr(have, k)} there, {getattr(want, k)} now" for k in SHAPE_KEYS
            if getattr(have, k) != getattr(want, k)]


def _check_tiny(model_dir: Path, want: ModelConfig) -> None:
    from jaxppo.models.config import load_config as load_model_config

    diff = shape_differences(load_model_config(model_dir)[0], want)
    if diff:
        raise ConfigError(f"{model_dir}: this run directory's embedded model has another shape ({'; '.join(diff)}; "
                          "model.tiny_*): use another trainer.default_local_dir, or the run's settings")


def check_warm_model(warm_dir: Path, model_cfg: ModelConfig, model_dir: Path) -> None:
    """The run directory's warm-start model was made from the model the config names (else: ConfigError)."""
    from jaxppo.models.config import load_config as load_model_config

    if not (warm_dir / "config.json").is_file():
        return
    diff = shape_differences(load_model_config(warm_dir)[0], model_cfg)
    if diff:
        raise ConfigError(f"{warm_dir}: this run directory's warm_model was made from another model than {model_dir} "
                          f"({'; '.join(diff)}): use another trainer.default_local_dir, or the run's model")


def check_tokenizer(tokenizer, tok_dir: Path, model_cfg: ModelConfig, model_dir: Path) -> None:
    """A tokenizer with ids past the model's vocabulary would fail in generation, after the whole setup."""
    if len(tokenizer) > model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer ({tok_dir}) has {len(tokenizer)} tokens, more than the model's vocabulary "
                          f"({model_dir}/config.json: vocab_size {model_cfg.vocab_size}): set data.tokenizer to the "
                          "model's own tokenizer")


def engine_dtype(cfg: Config) -> str:
    """Rollout weights: the compute dtype on accelerators; float32 on CPU (bf16 generation is slow there)."""
    return cfg.model.dtype if jax.default_backend() != "cpu" else "float32"


def attention_impl(cfg: Config) -> str | None:
    if cfg.model.attention_impl is not None:
        return cfg.model.attention_impl
    return "cudnn" if jax.default_backend() == "gpu" else None


__all__ = ["check_warm_model", "make_run_dir", "lock_run_dir", "write_atomic", "truncate_metrics", "check_reward_sources", "check_tokenizer",
           "prepare_data", "prepare_model_dir", "tiny_model_config", "engine_dtype", "attention_impl", "DTYPES"]
