# Device call (one H200): trainer starts in fresh processes on a committed config, the first start also the
# step benchmark (10 steps, medians of steps 3..10, standalone generation). Usage, from the repo root there:
#   bash docs/benchmarks/device/gpu_starts_2026-12-01.sh <config> <shape> <starts> <tag> [deadline_s]
# A series continued in a later call: FIRST_STEPS=1 FIRST_INDEX=<k> CLEAR=none bash ... (no step benchmark,
# starts numbered from k, caches kept).
# Writes $OUT/results_<tag>.jsonl (ledger rows), $OUT/starts_<tag>.json, $OUT/step_<tag>.json, $OUT/logs_<tag>.tgz.
set -u
config=$1 shape=$2 starts=$3 tag=$4 deadline=${5:-520}
# the device copy's .git can be older than the commit being run (seen 2026-12-01): name it
: "${JAXPPO_COMMIT:?set JAXPPO_COMMIT to the commit under test (git rev-parse --short HEAD here)}"
export JAXPPO_COMMIT PY=/opt/torch/.venv/bin/python3
mkdir -p /tmp/whl && $PY -m pip install -q --no-index --no-deps --upgrade --target /tmp/whl .whl/*.whl
export PYTHONPATH=/tmp/site:/tmp/whl:. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
$PY scripts/bench_start.py --config "$config" --shape "$shape" --starts "$starts" --first-steps "${FIRST_STEPS:-10}" \
  --first-index "${FIRST_INDEX:-1}" --deadline-s "$deadline" --clear "${CLEAR:-first}" --logs /tmp/starts_$tag --json-out $OUT/starts_$tag.json \
  --ledger $OUT/results_$tag.jsonl 2>&1 | tee $OUT/bench_start_$tag.log | grep -v '^{"start"'
first=/tmp/starts_$tag/start_${FIRST_INDEX:-1}
cp $first.json $OUT/step_$tag.json 2>/dev/null
grep -h -E "median of steps|timing_s/(step|gen|update|old|ref|values|sync)|perf/(mfu|gc)|memory|generation in loop|compiles|start:" \
  $first.log | head -40
tar czf $OUT/logs_$tag.tgz -C /tmp starts_$tag
