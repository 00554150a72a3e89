"""The learning test's two phases alone on this machine (tests/test_learning.py through the same helpers): the
embedded default's warm start (`seed_warm_start`, built once per suite run) and the 40-step PPO run after it.
From the repo root, with .venv built (scripts/env.sh), nothing else running:

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/benchmarks/ci_time_2026-12-06/learning_phases.py WORKDIR
"""

import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main() -> None:  # under a __main__ guard: the helpers' fork server imports this file again
    from tests.train_helpers import ROOT, read_metrics, run_train, seed_warm_start

    base = Path(sys.argv[1])
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    steps = 40
    args = [f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.save_freq=-1",
            "trainer.logger=[jsonl]"]
    config = ROOT / "configs" / "default.yaml"
    t = time.time()
    seed_warm_start(base / "run", base / "shared", *args, config=config)
    warm = time.time() - t
    t = time.time()
    run_train(base / "run", *args, timeout=1200, config=config, optimized=True)
    ppo = time.time() - t
    m = read_metrics(base / "run")
    step = sorted(m[s]["timing_s/step"] for s in range(1, steps + 1))[steps // 2]
    print(json.dumps({"warm_start_s": round(warm, 1), "ppo_40_steps_s": round(ppo, 1),
                      "step_median_s": round(step, 2)}))


if __name__ == "__main__":
    main()
