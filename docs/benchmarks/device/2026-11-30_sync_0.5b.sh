bash .gpukit/install.sh && source docs/benchmarks/device/2026-11-30_common.sh && \
timeout 300 $PY scripts/bench_sync.py --model qwen2.5-0.5b --reps 7 --eager --json-out $OUT/bench_sync_0.5b.json > $OUT/bench_sync_0.5b.log 2>&1
tail -4 $OUT/bench_sync_0.5b.log
