"""Metric sinks with verl's metric names: console (rich progress), JSONL, TensorBoard, W&B (optional)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np


def to_float(v: Any) -> float:
    return float(np.asarray(v))


def stats(prefix: str, x: np.ndarray, mask: np.ndarray | None = None) -> dict[str, float]:
    """{prefix}/mean, /max, /min over valid entries (0.0 when there are none)."""
    vals = np.asarray(x, np.float64)[np.asarray(mask) > 0] if mask is not None else np.asarray(x, np.float64).ravel()
    if vals.size == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": float(vals.mean()), f"{prefix}/max": float(vals.max()), f"{prefix}/min": float(vals.min())}


def rollout_metrics(g: dict[str, np.ndarray], step: int, kl_coef: float, max_response_length: int) -> dict[str, float]:
    """A PPO step's rollout / advantage metrics (verl's names) from every process's rows `g`: scores, rewards,
    advantages, returns, values, lengths, the engine's (`rollout_lp`) and the trainer's (`sampling_lp`)
    log-probs, response mask. The rollout-vs-trainer mismatch compares them under the same distribution: the one
    the engine samples from (after top-k / top-p when they truncate)."""
    from jaxppo.ppo import rollout_mismatch_metrics

    rmask = g["rmask"]
    m: dict[str, float] = {"actor/kl_coef": kl_coef, "training/global_step": float(step + 1)}
    m.update(stats("critic/score", g["scores"]))
    m.update(stats("critic/rewards", g["rewards"]))
    m.update(stats("critic/advantages", g["adv"], rmask))
    m.update(stats("critic/returns", g["ret"], rmask))
    if "values" in g:
        values, ret = g["values"], g["ret"]
        m.update(stats("critic/values", values, rmask))
        v = rmask > 0
        var_ret = np.var(ret[v])
        m["critic/vf_explained_var"] = float(1.0 - np.var(ret[v] - values[v]) / (var_ret + 1e-8))
    m.update(stats("response_length", g["lengths"]))
    m["response_length/clip_ratio"] = float(np.mean(g["lengths"] >= max_response_length))
    m.update(stats("prompt_length", g["prompt_lengths"]))
    # on the steps the engine returned log-probs (rollout.calculate_log_probs; else every 8th step: jaxppo/step.py)
    rollout_lp = g["rollout_lp"]
    known = rmask * np.isfinite(rollout_lp)
    if known.any():
        m.update({k: float(v) for k, v in rollout_mismatch_metrics(
            g["sampling_lp"], np.nan_to_num(rollout_lp, nan=0.0), known).items()})
    m["perf/total_num_tokens"] = float(g["prompt_lengths"].sum() + g["lengths"].sum())
    return m


class JsonlSink:
    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self.f.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")

    def close(self) -> None:
        self.f.close()


class TensorBoardSink:
    def __init__(self, path: Path, start_step: int = 0):
        from tensorboardX import SummaryWriter

        # events of the steps a resumed run writes again are dropped (as `setup.truncate_metrics` drops their lines)
        self.w = SummaryWriter(str(path), purge_step=start_step + 1 if start_step > 0 else 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class WandbSink:
    def __init__(self, project: str, name: str, config: dict, run_dir: Path):
        import wandb

        self.run = wandb.init(project=project, name=name, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class ConsoleSink:
    """A rich progress bar with step, score, KL and tokens/s; validation lines printed above it."""

    KEYS = (("critic/score/mean", "score"), ("actor/ppo_kl", "kl"), ("perf/throughput", "tok/s"),
            ("timing_s/step", "s/step"))

    def __init__(self, total_steps: int, start_step: int = 0):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]PPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[info]}"), transient=False)
        self.task = self.progress.add_task("ppo", total=total_steps, completed=start_step, info="")
        self.progress.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        info = "  ".join(f"{label} {metrics[k]:.4g}" for k, label in self.KEYS if k in metrics)
        vals = {k: v for k, v in metrics.items() if k.startswith(("val/", "val-core/"))}
        if vals:
            self.progress.console.print(f"step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in sorted(vals.items())))
        self.progress.update(self.task, completed=step, info=info)

    def close(self) -> None:
        self.progress.stop()


class MetricsLogger:
    def __init__(self, run_dir: Path, sinks: list[str], *, total_steps: int, start_step: int = 0,
                 project: str = "jaxppo", name: str = "run", config: dict | None = None):
        self.sinks = []
        for s in sinks:
            if s == "console":
                self.sinks.append(ConsoleSink(total_steps, start_step))
            elif s == "jsonl":
                self.sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
            elif s == "tensorboard":
                self.sinks.append(TensorBoardSink(run_dir / "tensorboard", start_step))
            elif s == "wandb":
                self.sinks.append(WandbSink(project, name, config or {}, run_dir))
            else:
                raise ValueError(f"unknown logger {s!r}; known: ['console', 'jsonl', 'tensorboard', 'wandb']")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        flat = {k: to_float(v) for k, v in metrics.items()}
        for s in self.sinks:
            s.log(step, flat)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
