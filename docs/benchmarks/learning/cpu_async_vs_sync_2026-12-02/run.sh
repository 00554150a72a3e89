# The embedded default (configs/default.yaml, CPU) to step 80 twice from the same seed: synchronous, and with
# rollouts one step ahead (trainer.async_rollout=true); the two runs of a seed at once. Prints each run's validation
# at steps 0 / 40 / 80 and its training score over steps 1-10 / 71-80, one JSON line per run.
# Usage: SEEDS="0 1 2" bash docs/benchmarks/learning/cpu_async_vs_sync_2026-12-02/run.sh OUT_DIR
# (seed S sets trainer.seed=S data.seed=S, as docs/benchmarks/learning/cpu_default_2026-12-02 did; SEEDS default "0";
# EXTRA: further overrides for both runs, e.g. EXTRA="actor.optim.lr=2e-4")
set -eu
out=${1:?output directory}
mkdir -p "$out"
for seed in ${SEEDS:-0}; do
  for mode in false true; do
    python -m jaxppo.train trainer.async_rollout=$mode trainer.seed=$seed data.seed=$seed trainer.test_freq=40 \
      trainer.save_freq=-1 "trainer.logger=[jsonl]" trainer.default_local_dir="$out/seed${seed}_async_$mode" ${EXTRA:-} \
      > "$out/seed${seed}_async_$mode.log" 2>&1 &
  done
  wait
done
python - "$out" ${SEEDS:-0} <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for seed in sys.argv[2:]:
    for mode in ("false", "true"):
        m = {}
        for line in (out / f"seed{seed}_async_{mode}" / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            m.setdefault(r["step"], {}).update(r)
        score = [m[s]["critic/score/mean"] for s in range(1, 81)]
        print(json.dumps({"seed": int(seed), "async_rollout": mode == "true", "val_step0": m[0]["val/score"],
                          "val_step40": m[40]["val/score"], "val_step80": m[80]["val/score"],
                          "train_score_1_10": sum(score[:10]) / 10, "train_score_71_80": sum(score[-10:]) / 10,
                          "step_s_median": sorted(m[s]["timing_s/step"] for s in range(3, 81))[39]}))
PYEOF
