#!/usr/bin/env bash
# XLA's CPU fusion emitters, MLIR (XLA's default) against the older loop emitters, for the suite's FAST-compiled runs:
# two clones of this checkout's HEAD, one with tests/train_helpers.py's FAST_COMPILE without
# --xla_cpu_use_fusion_emitters=false (a, the MLIR emitters) and one with it (b), each test selection run from a cold
# compilation cache (a fresh HOME: the cache is ~/.cache/jaxppo/xla) in turn, a then b, REPS times. One JSON line per
# run on stdout. From the repo root, with .venv built (scripts/env.sh), nothing else running:
#   bash docs/benchmarks/ci_time_2026-12-06/fusion_emitters_ab.sh 1 2 tests/test_compare.py tests/test_recipes.py ...
#   (REPS, then JAXPPO_TEST_WORKERS, then the tests)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
REPS=$1; WORKERS=$2; shift 2
W=$(mktemp -d)
for v in a b; do git clone -q "$ROOT" "$W/$v"; done
sed -i 's/ --xla_cpu_use_fusion_emitters=false"/"/' "$W/a/tests/train_helpers.py"
grep -q 'FAST_COMPILE = "--xla_backend_optimization_level=0"$' "$W/a/tests/train_helpers.py"
grep -q 'xla_cpu_use_fusion_emitters=false"$' "$W/b/tests/train_helpers.py"
export JAXPPO_VENV="$ROOT/.venv"
for rep in $(seq "$REPS"); do
  for v in a b; do
    rm -rf "$W/home_$v" && mkdir -p "$W/home_$v"
    s=$(date +%s.%N)
    (cd "$W/$v" && HOME="$W/home_$v" JAXPPO_TEST_WORKERS="$WORKERS" bash scripts/test.sh -q -p no:cacheprovider \
      --basetemp="$W/bt_$v" "$@" > "$W/$v.log" 2>&1) || true
    e=$(date +%s.%N)
    echo "{\"emitters\": \"$([ $v = a ] && echo mlir || echo older)\", \"rep\": $rep, \"workers\": $WORKERS," \
         "\"wall_s\": $(echo "$e - $s" | bc), \"result\": \"$(tail -1 "$W/$v.log")\", \"tests\": \"$*\"}"
  done
done
rm -rf "$W"
