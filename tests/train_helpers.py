"""Small runs of `python -m jaxppo.train` for the trainer tests."""

from __future__ import annotations

import json
import subprocess
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


def run_train(run_dir: Path, *overrides: str, check: bool = True, timeout: float = 600,
              extra_env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, PYTHONPATH=str(ROOT), **(extra_env or {}))
    env.pop("XLA_FLAGS", None)  # one CPU device, like a user's run
    res = subprocess.run([sys.executable, "-m", "jaxppo.train", f"trainer.default_local_dir={run_dir}", *overrides],
                         capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
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
