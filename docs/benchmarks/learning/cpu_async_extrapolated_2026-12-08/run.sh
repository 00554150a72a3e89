# One step ahead with the sampler fed linearly extrapolated weights, theta_k + ALPHA (theta_k - theta_{k-1}), on the
# embedded default (configs/default.yaml, CPU) to step 80: a scratch change (extrapolate.patch, jaxppo/ahead.py),
# not a feature. The engine's log-probs are then the extrapolated policy's, so bypass mode's ratio stays exact.
# Usage, from the repository root: ALPHAS="1.0 0.5" SEEDS="0 1 2 3 4" bash \
#   docs/benchmarks/learning/cpu_async_extrapolated_2026-12-08/run.sh OUT_DIR
# (a worktree of HEAD with the patch applied under OUT_DIR/tree; two runs at once; seed S sets trainer.seed=S
# data.seed=S as every record here does)
set -eu
out=$(realpath -m "${1:?output directory}")
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
git worktree add -q --detach "$out/tree" HEAD
git -C "$out/tree" apply "$here/extrapolate.patch"
runs=()
for a in ${ALPHAS:-1.0}; do for s in ${SEEDS:-0}; do runs+=("$a $s"); done; done
one() {  # alpha seed
  (cd "$out/tree" && JAXPPO_EXTRAP=$1 python -m jaxppo.train trainer.async_rollout=true trainer.seed=$2 data.seed=$2 \
    trainer.test_freq=40 trainer.save_freq=-1 "trainer.logger=[jsonl]" trainer.default_local_dir="$out/a$1_s$2" \
    > "$out/a$1_s$2.log" 2>&1)
}
for ((i = 0; i < ${#runs[@]}; i += 2)); do
  one ${runs[i]} &
  if ((i + 1 < ${#runs[@]})); then one ${runs[i + 1]} & fi
  wait
done
