# Device call (one H100, 2026-12-05, at 0bc2fe4; docs/benchmarks.md, "`rollout.cuda_mps` on a GPU"): stop the queue, run
# the 0.5B one-step-ahead config under the run's MPS daemon with the trainer at 80 % of the SMs
# (rollout.cuda_mps_trainer_sm_percent, a key taken back out in 28f1fff) under faulthandler, abort it after 140 s for
# its threads' stacks, then the same with plain rollout.cuda_mps=true (cut at 250 s). Run from the repo root there
# after the GPU kit's install (docs/benchmarks/device/2026-12-02_queue.sh).
pkill -f run_queue; pkill -f bench_ppo_step; sleep 3; for d in /tmp/jaxppo-mps-*; do echo quit | CUDA_MPS_PIPE_DIRECTORY=$d nvidia-cuda-mps-control; done; sleep 2
export PYTHONPATH=/tmp/site:/tmp/whl:. PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
PY=/opt/torch/.venv/bin/python3
B="$PY -X faulthandler scripts/bench_ppo_step.py --no-ledger --config configs/gsm8k_qwen2.5_0.5b_ahead.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone"
$B --json-out $OUT/share80.json --workdir /tmp/d80 rollout.cuda_mps=true rollout.cuda_mps_trainer_sm_percent=80 > $OUT/share80.log 2>&1 &
p=$!; sleep 140; kill -ABRT $p; sleep 5
grep -v "Capturing\|cuda_timer\|host mappings" $OUT/share80.log | tail -60
pkill -f bench_ppo_step; sleep 3; for d in /tmp/jaxppo-mps-*; do echo quit | CUDA_MPS_PIPE_DIRECTORY=$d nvidia-cuda-mps-control 2>/dev/null; done; sleep 2
echo "===== no share"
timeout 250 $B --json-out $OUT/plain.json --workdir /tmp/dp rollout.cuda_mps=true > $OUT/plain.log 2>&1; echo rc=$?
grep -v "Capturing\|cuda_timer\|host mappings\|INFO vllm\|WARNING vllm" $OUT/plain.log | tail -25
