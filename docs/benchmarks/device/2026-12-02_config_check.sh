# Device call (one H200): committed configs through scripts/check_configs.py (fresh process each, random weights of
# the shape, no overrides), and optionally one config's step benchmark. Usage, from the repo root there:
#   JAXPPO_COMMIT=<commit> bash docs/benchmarks/device/2026-12-02_config_check.sh <checks,comma,list> <steps> <tag>
#   JAXPPO_COMMIT=<commit> BENCH="<config> <shape> <steps>" bash ... (the step benchmark instead)
# Writes $OUT/results_<tag>.jsonl (ledger rows), $OUT/check_<tag>.log, $OUT/logs_<tag>.tgz (each run's log + JSON).
set -u
: "${JAXPPO_COMMIT:?set JAXPPO_COMMIT to the commit under test (git rev-parse --short HEAD here)}"
export JAXPPO_COMMIT PY=/opt/torch/.venv/bin/python3
mkdir -p /tmp/whl && $PY -m pip install -q --no-index --no-deps --upgrade --target /tmp/whl .whl/*.whl
export PYTHONPATH=/tmp/site:/tmp/whl:. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_ENABLE_V1_MULTIPROCESSING=0
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
checks=$1 steps=$2 tag=$3
# the logs come back even when the call's time limit ends the command (each config is also cut at PER_CHECK_S)
trap 'tar czf $OUT/logs_$tag.tgz -C /tmp/cc --exclude="*/run" --exclude="*/data" --exclude="*/tokenizer" \
  --exclude="qwen*/*" --exclude="bench" . 2>/dev/null' EXIT
if [ -n "${BENCH:-}" ]; then
  set -- $BENCH
  $PY scripts/bench_ppo_step.py --config "$1" --shape "$2" --steps "$3" --no-standalone --ledger $OUT/results_$tag.jsonl \
    --json-out $OUT/step_$tag.json --workdir /tmp/cc/bench 2>&1 | tee $OUT/check_$tag.log | \
    grep -v -E "^\{\"step\"|INFO vllm|WARNING vllm" | tail -60
else
  $PY scripts/check_configs.py --only "$checks" --steps "$steps" --timeout "${PER_CHECK_S:-480}" \
    --ledger $OUT/results_$tag.jsonl --workdir /tmp/cc \
    2>&1 | tee $OUT/check_$tag.log
  grep -h -A14 "memory plan per device" /tmp/cc/*.log | head -80
fi
