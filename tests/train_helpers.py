"""Small runs of `python -m jaxppo.train` for the trainer tests."""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the embedded default, shrunk to seconds: same task, tokenizer, model family, warm start and loop
FAST = ["data.train_batch_size=8", "data.max_response_length=12", "data.synthetic_train_size=200",
        "data.synthetic_val_size=16", "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_device=4", "critic.ppo_micro_batch_size_per_device=4",
        "actor.log_prob_micro_batch_size_per_device=8", "critic.log_prob_micro_batch_size_per_device=8",
        "rollout.n=2", "model.tiny_hidden_size=64", "trainer.sft_warmup_steps=5", "trainer.test_freq=2",
        "trainer.logger=[jsonl]"]


# a GSM8K recipe config (configs/gsm8k_*.yaml) pointed at the embedded default's task, shrunk like FAST: the
# recipe's algorithm, loss, sampling and packing settings on the synthetic data, with the tiny model and the
# transformers engine on CPU
ON_EMBEDDED_TASK = ["data.train_files=[]", "data.val_files=[]", "model.path=null", "rollout.engine=hf",
                    "model.dtype=float32", "model.remat=none", "data.max_prompt_length=48",
                    "data.max_response_length=12", "data.train_batch_size=8", "data.val_batch_size=16",
                    "data.synthetic_train_size=200", "data.synthetic_val_size=16", "data.synthetic_operators=+",
                    "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4", "model.tiny_hidden_size=64",
                    "trainer.sft_warmup_steps=5", "trainer.sft_lr=3e-3", "trainer.test_freq=3",
                    "trainer.save_freq=-1", "trainer.logger=[jsonl]"]


# The suite's programs are compiled by LLVM at its lowest optimisation level (tests/conftest.py sets it for the test
# processes, train_env for the runs they start): XLA's CPU compiles are most of the suite's work, and at level 0
# tests/test_engine.py took 379 s of CPU instead of 569 s (2-core AMD EPYC, 2026-12-03), same results. The learning
# runs (`learns`, the warm start, the LoRA run) compile as a user's run does (`optimized=True`): their hundreds of
# steps at the embedded default's scale run faster for it, and their thresholds were seen that way.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def train_env(devices: int = 1, optimized: bool = False, **extra: str) -> dict:
    """The environment of a run in a subprocess: `devices` CPU devices (one, like a user's run); XLA's CPU code
    compiled at LLVM's lowest level unless `optimized` (FAST_COMPILE)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    flags = [] if optimized else [FAST_COMPILE]
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def run_train(run_dir: Path, *overrides: str, check: bool = True, timeout: float = 600,
              extra_env: dict | None = None, config: str | Path | None = None,
              optimized: bool = False) -> subprocess.CompletedProcess:
    """`python -m jaxppo.train [--config config] trainer.default_local_dir=run_dir overrides...` in a subprocess."""
    head = ["--config", str(config)] if config is not None else []
    res = subprocess.run([sys.executable, "-m", "jaxppo.train", *head, f"trainer.default_local_dir={run_dir}",
                          *overrides],
                         capture_output=True, text=True, timeout=timeout,
                         env=train_env(optimized=optimized, **(extra_env or {})), cwd=ROOT)
    if check and res.returncode != 0:
        raise AssertionError(res.stdout[-3000:] + res.stderr[-5000:])
    return res


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """step -> metrics, the last record of each step winning (a resumed run repeats steps)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], {}).update(rec)
    return out


def start_train(run_dir: Path, *overrides: str, optimized: bool = False, **popen_kw) -> subprocess.Popen:
    """`python -m jaxppo.train` started in the background (output discarded unless popen_kw says)."""
    popen_kw.setdefault("stdout", subprocess.DEVNULL)
    popen_kw.setdefault("stderr", subprocess.DEVNULL)
    return subprocess.Popen([sys.executable, "-m", "jaxppo.train", f"trainer.default_local_dir={run_dir}", *overrides],
                            cwd=ROOT, env=train_env(optimized=optimized), **popen_kw)


def wait_until(ready, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    """Poll the file-system condition `ready()` while `proc` runs (fails if it ends first or times out)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def logged_step(run_dir: Path, step: int) -> bool:
    path = Path(run_dir) / "metrics.jsonl"
    return path.is_file() and f'"step": {step}' in path.read_text()


def all_records(run_dir: Path) -> list[dict]:
    """Every metrics record in the order written (a resumed run appends after the interrupted one)."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_resumed_at_checkpoint(run_dir: Path, output: str) -> int:
    """The second process of a run resumed from its checkpoint: it says so, and no step up to the checkpoint was
    logged twice (a run that silently started over would repeat steps 1..N). Returns the step resumed from."""
    import re

    found = re.findall(r"resumed from step (\d+)", output)
    assert found, "the resumed process did not report resuming"
    step = int(found[-1])
    steps = [r["step"] for r in all_records(run_dir)]
    assert step >= 1 and all(steps.count(s) == 1 for s in range(1, step + 1)), (step, steps)
    return step


# ------------------------------------------------------------------ the embedded default's warm start, built once

# what the warm start reads (jaxppo/warmstart.py, jaxppo/setup.py): the data, the model, the mesh, the actor's
# micro-batching, the batch size (prompts x samples), the seed and the warm start's own settings
_WARM_KEYS = ("data", "model", "mesh", "actor.ppo_micro_batch_size_per_device", "actor.logprob_chunk_size",
              "actor.logprob_remat", "rollout.n", "trainer.seed", "trainer.sft_warmup_steps", "trainer.sft_lr")


def warm_start_key(*overrides: str, config: str | Path | None = None) -> str:
    import dataclasses
    import hashlib

    from jaxppo.config import load_config

    cfg = load_config(config or ROOT / "configs" / "default.yaml", overrides)
    parts = {}
    for key in _WARM_KEYS:
        node = cfg
        for name in key.split("."):
            node = getattr(node, name)
        parts[key] = dataclasses.asdict(node) if dataclasses.is_dataclass(node) else node
    for name in ("val_files", "synthetic_val_size", "val_batch_size"):  # validation only
        parts["data"].pop(name)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def seed_warm_start(run_dir: Path, cache_root: Path, *overrides: str, config: str | Path | None = None) -> None:
    """Put the embedded default's warm-start model for `overrides` into `run_dir/warm_model`, where the trainer
    takes it instead of warming up again (jaxppo/trainer.py). The warm start itself runs once per test run for
    each setting that it reads (`_WARM_KEYS`), in `python -m jaxppo.train`, under a file lock shared by the
    pytest-xdist workers; it is deterministic on one machine, so every test gets the model it would have
    trained. The learning tests then measure the PPO phase, as their first validation (step 0) always did."""
    import shutil

    from filelock import FileLock

    key = warm_start_key(*overrides, config=config)
    cache = Path(cache_root) / f"warm_{key}"
    with FileLock(str(cache) + ".lock"):
        if not (cache / "warm_model" / "config.json").is_file():
            shutil.rmtree(cache, ignore_errors=True)
            run_train(cache, *overrides, "trainer.total_training_steps=1", "trainer.val_before_train=false",
                      "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[jsonl]", timeout=900,
                      config=config, optimized=True)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    shutil.copytree(cache / "warm_model", Path(run_dir) / "warm_model")


def shared_tmp(tmp_path_factory) -> Path:
    """A directory shared by this test run's pytest-xdist workers (and by nothing else)."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    root = base.parent / f"shared_{uid}" if uid else base / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


def learns(tmp_path_factory, config: str, steps: int, *overrides: str) -> tuple[float, float, float, float]:
    """(validation at step 0, at `steps`; training score over the first 10 steps, over the last 10)."""
    run = tmp_path_factory.mktemp("learn") / "run"
    args = [f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.save_freq=-1",
            "trainer.logger=[jsonl]", *overrides]
    seed_warm_start(run, shared_tmp(tmp_path_factory), *args, config=ROOT / "configs" / config)
    run_train(run, *args, timeout=1200, config=ROOT / "configs" / config, optimized=True)
    metrics = read_metrics(run)
    score = [metrics[s]["critic/score/mean"] for s in range(1, steps + 1)]
    return metrics[0]["val/score"], metrics[steps]["val/score"], sum(score[:10]) / 10, sum(score[-10:]) / 10
