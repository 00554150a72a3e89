source docs/benchmarks/device/2026-11-30_common.sh
timeout 100 $PY docs/benchmarks/device/2026-11-30_packing_poison_check.py 2>&1 | grep -v "^W\|^I" | tail -2
timeout 200 $PY scripts/bench_packing.py --model qwen2.5-0.5b --seqs 64 --micro 8 --budget 8192 --steps 3 --check \
  --json-out $OUT/pack_check.json > $OUT/pack_check.log 2>&1
grep "check" $OUT/pack_check.log | cut -c1-330; tail -3 $OUT/pack_check.log
