"""What one test start costs, at two commits side by side: a 2-step FAST run (tests/train_helpers.py) in a process
forked from one that imported what the tests' fork server imports, as the tests run theirs; the trainer's start
(`PPOTrainer.__init__`: data, memory plan = the step's programs traced, lowered and loaded from JAX's persistent
cache, states) and the whole run, and the number of programs compiled (`jax_log_compiles`). From the repo root,
with .venv built (scripts/env.sh):

    .venv/bin/python docs/benchmarks/ci_time_2026-12-06/start_cost.py COMMIT_A COMMIT_B [--repeats 5]

Each commit is checked out in a worktree of its own under a temporary directory; the runs alternate between the two
(A, B, A, B, ...) so that the machine's changing pace falls on both alike; the first run of each commit (filling
the persistent cache) is not counted. Prints one JSON line per run and one with the medians per commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# runs inside the worktree (its own jaxppo and tests): the fork server's imports, then a forked child per run
CHILD = r"""
import logging, os, sys, time
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.getcwd())
import tests.train_preload  # noqa: F401  (what the tests' fork server imports)
out = sys.argv[1]
pid = os.fork()
if pid:
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
import jax
from jaxppo import train
import jaxppo.trainer as T
from tests.train_helpers import FAST
compiles = [0]
class Count(logging.Filter):
    def filter(self, rec):
        compiles[0] += rec.getMessage().startswith("Compiling jit(")
        return False
jax.config.update("jax_log_compiles", True)
logging.getLogger("jax._src.interpreters.pxla").addFilter(Count())
logging.getLogger("jax._src.dispatch").addFilter(Count())
init = T.PPOTrainer.__init__
took = {}
def timed(self, *a, **k):
    t = time.perf_counter(); init(self, *a, **k); took["start_s"] = time.perf_counter() - t
T.PPOTrainer.__init__ = timed
t = time.perf_counter()
rc = train.main([*FAST, "trainer.total_training_steps=2", f"trainer.default_local_dir={out}",
                 "trainer.val_before_train=false", "trainer.test_freq=-1"])
took["run_s"] = time.perf_counter() - t
print("START_COST " + __import__("json").dumps({"rc": rc, "compiles": compiles[0],
                                                **{k: round(v, 2) for k, v in took.items()}}), flush=True)
os._exit(0)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commits", nargs=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="start_cost_"))
    trees = {}
    for c in args.commits:
        trees[c] = tmp / c
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(trees[c]), c], cwd=ROOT, check=True)
    rows: dict[str, list[dict]] = {c: [] for c in args.commits}
    try:
        for i in range(args.repeats + 1):
            for c in args.commits:
                out = tmp / f"run_{c}_{i}"
                res = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", CHILD, str(out)], cwd=trees[c],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONPATH=str(trees[c])))
                line = [ln for ln in res.stdout.splitlines() if ln.startswith("START_COST ")]
                if res.returncode != 0 or not line:
                    sys.exit(f"{c} run {i} failed (exit {res.returncode}):\n{res.stdout[-3000:]}")
                row = {"commit": c, "run": i, "counted": i > 0, **json.loads(line[-1].split(" ", 1)[1])}
                print(json.dumps(row), flush=True)
                if i > 0:
                    rows[c].append(row)
        for c in args.commits:
            med = {k: statistics.median(r[k] for r in rows[c]) for k in ("start_s", "run_s", "compiles")}
            starts = [r["start_s"] for r in rows[c]]
            print(json.dumps({"commit": c, "runs": len(rows[c]), "median": med,
                              "range_start_s": [min(starts), max(starts)]}))
    finally:
        for c in args.commits:
            subprocess.run(["git", "worktree", "remove", "--force", str(trees[c])], cwd=ROOT, check=False)
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


if __name__ == "__main__":
    main()
