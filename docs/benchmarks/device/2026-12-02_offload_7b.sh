# Device call (one H200): the optimizer offload's update program at Qwen2.5-7B's shapes
# (2026-12-02_offload_update.py: device memory per variant, the link's rate), then the memory plan of
# configs/gsm8k_grpo_qwen2.5_7b.yaml (plan only, through 2026-12-02_plan_timing.sh). Writes $OUT/offload_update.log
# and the plan's log.
set -u
export PY=/opt/torch/.venv/bin/python3
mkdir -p /tmp/whl && $PY -m pip install -q --no-index --no-deps --upgrade --target /tmp/whl .whl/*.whl
PYTHONPATH=/tmp/site:/tmp/whl:. XLA_PYTHON_CLIENT_PREALLOCATE=false $PY docs/benchmarks/device/2026-12-02_offload_update.py \
  2>&1 | tee $OUT/offload_update.log | grep "^{"
bash docs/benchmarks/device/2026-12-02_plan_timing.sh "$@"
