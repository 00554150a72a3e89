# The embedded default (configs/default.yaml, CPU) to step 80 one step ahead with the old policy's log-probs
# recomputed by the trainer and no correction (verl's PPO step one step off without a rollout correction; its
# one-step-off recipe now sets bypass mode): rollout_rs=token_k1 with bounds that reject nothing keeps trainer.async_rollout from implying bypass
# mode, so the old-log-prob pass runs and nothing reweights the loss. Two seeds at once on a 2-core machine.
# Usage: bash docs/benchmarks/learning/cpu_async_recompute_2026-12-05/run.sh OUT_DIR
set -eu
out=${1:?output directory}
mkdir -p "$out"
run() {
  python -m jaxppo.train trainer.async_rollout=true trainer.seed=$1 data.seed=$1 trainer.test_freq=40 \
    trainer.save_freq=-1 "trainer.logger=[jsonl]" trainer.default_local_dir="$out/seed$1_recompute" \
    algorithm.rollout_correction.rollout_rs=token_k1 algorithm.rollout_correction.rollout_rs_threshold=1e-9_1e9 \
    > "$out/seed$1.log" 2>&1
}
run 0 & run 1 & wait
run 2
