bash .gpukit/install.sh && source docs/benchmarks/device/2026-11-30_common.sh && \
timeout 500 $PY scripts/bench_sync.py --model qwen2.5-1.5b,qwen2.5-7b --reps 7 --eager --json-out $OUT/bench_sync.json > $OUT/bench_sync.log 2>&1
tail -8 $OUT/bench_sync.log
