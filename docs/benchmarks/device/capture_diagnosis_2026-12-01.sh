# Device call: why does vLLM's FULL CUDA-graph capture abort on the first start on a fresh machine?
# Run 1 is the machine's first start (control, committed 0.5B config); run 2 clears every cache we know of
# (driver JIT cache, vLLM / inductor / Triton caches, page cache) and starts again; run 3 does the same with
# torch.cuda.graph's capture_error_mode=thread_local. CUDA_LOG_FILE names the failing API call and thread.
export PY=/opt/torch/.venv/bin/python3
mkdir -p /tmp/whl && $PY -m pip install -q --no-index --no-deps --upgrade --target /tmp/whl .whl/*.whl
export PYTHONPATH=/tmp/site:/tmp/whl:. PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
{ uptime; nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv; ls -la ~ ~/.cache ~/.nv 2>&1; ls /tmp; } > $OUT/fresh_state.txt 2>&1
clear_caches() { rm -rf ~/.nv ~/.cache/vllm ~/.cache/torch ~/.cache/flashinfer ~/.triton /tmp/torchinductor_* /tmp/jaxppo_ppo_bench; sync; echo 3 > /proc/sys/vm/drop_caches; }
watch_threads() {  # thread id -> name of the benchmark process, sampled while it runs
  while sleep 0.5; do for p in $(pgrep -f bench_ppo_step.py); do for t in /proc/$p/task/*; do echo "$(basename $t) $(cat $t/comm 2>/dev/null)" >> $1; done; done; done
}
run() {  # name, extra env
  watch_threads $OUT/threads_$1.txt & W=$!
  env $2 CUDA_LOG_FILE=$OUT/cuda_log_$1.txt timeout 220 $PY -X faulthandler scripts/bench_ppo_step.py \
    --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 1 > $OUT/start_$1.log 2>&1
  echo "$1 rc=$?"; kill $W; sort -u -o $OUT/threads_$1.txt $OUT/threads_$1.txt
  grep -a -E "Capturing CUDA graphs \(FULL\)|CUDA error|Fatal Python|Thread 0x|File .*line" $OUT/start_$1.log | tail -25 | cut -c1-300
  find ~/.nv ~/.cache ~/.triton /tmp/torchinductor_root -maxdepth 2 2>/dev/null | head -30 > $OUT/caches_after_$1.txt
}
run first NOTHING=1
clear_caches; run cleared NOTHING=1
clear_caches; run threadlocal JAXPPO_CAPTURE_MODE=thread_local
for f in $OUT/cuda_log_*.txt; do echo "== $f"; head -c 3000 $f; done
