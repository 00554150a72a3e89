source docs/benchmarks/device/2026-11-30_common.sh
( export CUDA_VISIBLE_DEVICES=0
  B="scripts/bench_update.py --model qwen2.5-1.5b --batch 8 --seq 1024 --steps 8 --remat dots_attn"
  timeout 400 $PY $B --head-remat 0 --unroll 28 --json-out $OUT/upd_unroll28.json > $OUT/upd_unroll28.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  B="scripts/bench_update.py --model qwen2.5-1.5b --batch 8 --seq 1024 --steps 8 --remat dots_attn"
  timeout 250 $PY $B --head-remat 0 --no-torch --profile /tmp/p0 --json-out $OUT/upd_head0_prof.json > $OUT/upd_head0_prof.log 2>&1
  timeout 250 $PY $B --head-remat 0 --json-out $OUT/upd_head0.json > $OUT/upd_head0.log 2>&1 ) &
wait
tail -5 $OUT/upd_unroll28.log; head -12 $OUT/upd_head0_prof.log; tail -5 $OUT/upd_head0.log
