#!/usr/bin/env bash
# Two (or one) embedded-default runs at once on this machine, as the two CI test workers run theirs, with an
# environment of your choice: the medians of steps 3..6 of each run (step, actor update, generation) and the
# wall time of the pair. From the repo root, with .venv built (scripts/env.sh):
#   bash docs/benchmarks/ci_time_2026-12-06/two_runs_at_once.sh LABEL RUNS [VAR=value ...]
# e.g. `... passive 2 OMP_WAIT_POLICY=PASSIVE` against `... default 2`.
set -euo pipefail
label=$1; runs=$2; shift 2
args=(trainer.total_training_steps=6 trainer.sft_warmup_steps=3 trainer.sft_target_nll=0 trainer.test_freq=-1
      trainer.val_before_train=false trainer.save_freq=-1 "trainer.logger=[jsonl]")
tmp=$(mktemp -d)
start=$(date +%s.%N)
for i in $(seq 1 "$runs"); do
  env JAX_PLATFORMS=cpu "$@" .venv/bin/python -m jaxppo.train "trainer.default_local_dir=$tmp/run_$i" "${args[@]}" \
    > "$tmp/run_$i.log" 2>&1 &
done
wait
end=$(date +%s.%N)
.venv/bin/python - "$label" "$start" "$end" "$tmp" "$runs" <<'PY'
import json, statistics, sys
label, s, e, tmp, runs = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5])
out = []
for i in range(1, runs + 1):
    recs = [json.loads(line) for line in open(f"{tmp}/run_{i}/metrics.jsonl")]
    med = lambda k: round(statistics.median(r[k] for r in recs if k in r and r["step"] >= 3), 2)  # noqa: E731
    out.append({"step": med("timing_s/step"), "update_actor": med("timing_s/update_actor"), "gen": med("timing_s/gen")})
print(json.dumps({"label": label, "runs": runs, "wall_s": round(e - s, 1), "medians_steps_3_6": out}))
PY
rm -rf "$tmp"
