"""The same run in several step modes, one after another, on this machine: the step's time and its phases, and
whether the training scores agree.

    python scripts/compare_modes.py --steps 30 --modes sync,critic,ahead [--config configs/default.yaml] [overrides]

Modes: `sync` (the synchronous step), `critic` (`trainer.rollout_during_critic_update=true`: the next batch generated
while the critic updates, on-policy) and `ahead` (`trainer.async_rollout=true`: one step ahead, off-policy). Each run
is a fresh `python -m jaxppo.train` in its own run directory (no validation, no checkpoints); the medians are over
its steps after the first `--skip`. The means over the run of the training score and of the actor's gradient norm
tell an on-policy mode (equal to the synchronous run's, to the float) from one that learns otherwise. Appends one
`"bench": "step_modes"` row per run to the ledger named by `--ledger` (none by default).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import ledger  # noqa: E402

MODES = {"sync": [], "critic": ["trainer.rollout_during_critic_update=true"], "ahead": ["trainer.async_rollout=true"]}
PHASES = ("step", "gen", "gen_wait", "update_actor", "update_critic")


def run(config: str, mode: str, steps: int, overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    args = [sys.executable, "-m", "jaxppo.train", "--config", config, f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "trainer.save_freq=-1", "trainer.resume_mode=disable", "trainer.logger=[jsonl]", *MODES[mode], *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "timing_s/step" in r], wall


def fresh_dir(workdir: Path, mode: str) -> Path:
    """`<workdir>/<mode>_<i>` with the first i not taken: a mode may be named twice, and a run directory already in
    `--workdir` (an earlier comparison's) is never trained into again."""
    i = 0
    while (workdir / f"{mode}_{i}").exists():
        i += 1
    return workdir / f"{mode}_{i}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the medians")
    ap.add_argument("--modes", default="sync,critic,ahead")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--ledger", default="")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; known: {list(MODES)}")
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="jaxppo_modes_"))
    print(f"{'mode':8} {'wall s':>7} " + " ".join(f"{p:>13}" for p in PHASES) + "  training score (mean)")
    for mode in modes:
        run_dir = fresh_dir(workdir, mode)
        rows, wall = run(a.config, mode, a.steps, a.overrides, run_dir)
        timed = rows[a.skip:]
        med = {p: float(np.median([r.get(f"timing_s/{p}", 0.0) for r in timed])) for p in PHASES}
        score = float(np.mean([r["critic/score/mean"] for r in rows]))
        grad = float(np.mean([r.get("actor/grad_norm", np.nan) for r in rows]))  # a fingerprint of what trained
        print(f"{mode:8} {wall:7.1f} " + " ".join(f"{med[p]:13.3f}" for p in PHASES) + f"  {score!r}", flush=True)
        if a.ledger:
            figures = {"wall_s": wall, "score_mean": score, "actor_grad_norm_mean": grad,
                       **{f"timing_s/{p}": v for p, v in med.items()}}
            row = ledger.make_row("step_modes", figures, config=a.config, overrides=[*MODES[mode], *a.overrides],
                                  samples={"timing_s": len(timed), "score_mean": len(rows),
                                           "actor_grad_norm_mean": len(rows)}, mode=mode)
            ledger.append(row, a.ledger)


if __name__ == "__main__":
    main()
