# Device call (one H200): how long the memory plan takes to compile, per program and probe (JAX's compile log), for
# config/shape pairs given as "config:shape" arguments, as the child process that plans a GPU run does it (JAX
# growing on demand, probes without autotuning). Writes $OUT/plan_<shape>_<i>.log (i: the pair's place in the
# arguments; a pair given twice shows a cold start beside one with JAX's persistent cache filled).
set -u
export PY=/opt/torch/.venv/bin/python3
mkdir -p /tmp/whl && $PY -m pip install -q --no-index --no-deps --upgrade --target /tmp/whl .whl/*.whl
export PYTHONPATH=/tmp/site:/tmp/whl:. PYTHONUNBUFFERED=1 JAXPPO_PLAN_CHILD=1 JAXPPO_PROBE_WITHOUT_AUTOTUNE=1 \
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 JAX_LOG_COMPILES=1
i=0
for pair in "$@"; do
  config=${pair%%:*} shape=${pair##*:} w=/tmp/pt/$shape i=$((i + 1)) log=$OUT/plan_${shape}_$i.log
  $PY - "$shape" "$w" <<'PYEOF'
import sys
from pathlib import Path
from scripts.shapes import SHAPES, write_config_dir
from scripts.bench_ppo_step import benchmark_tokenizer
from jaxppo.data.synthetic import ArithmeticTask, write_dataset
shape, w = sys.argv[1], Path(sys.argv[2])
write_config_dir(shape, w / shape)
benchmark_tokenizer(w / "tok", SHAPES[shape].vocab_size)
write_dataset(w / "data", ArithmeticTask(num_operands=8, max_digits=3, operators="+-*"), train_size=4000, val_size=8)
PYEOF
  t0=$(date +%s.%N)
  $PY -m jaxppo.train --config "$config" model.path=$w/$shape model.random_init=true \
    data.train_files=[$w/data/train.parquet] data.val_files=[] data.tokenizer=$w/tok trainer.plan_only=true \
    trainer.default_local_dir=$w/run > $log 2>&1
  rc=$? t1=$(date +%s.%N)
  echo "== $config on $shape: exit $rc, $(awk "BEGIN{print $t1 - $t0}") s"
  grep -o "Finished XLA compilation of [^ ]* in [0-9.]* sec" $log | \
    awk '{n[$5]++; s[$5]+=$7; tot+=$7} END {for (k in n) printf "  %-40s %3d compiles %7.1f s\n", k, n[k], s[k]; printf "  total XLA compile %.1f s\n", tot}'
  for what in "tracing + transforming" "jaxpr to MLIR module conversion"; do
    grep -o "Finished $what [^ ]* in [0-9.]* sec" $log | awk -v w="$what" '{t+=$(NF-1); n++} END {printf "  %-40s %3d       %7.1f s\n", w, n, t}'
  done
  grep -A14 "memory plan per device" $log | head -16
done
