source docs/benchmarks/device/2026-11-30_common.sh
B="scripts/bench_update.py --batch 8 --seq 1024 --steps 8 --remat dots_attn"
( export CUDA_VISIBLE_DEVICES=1
  timeout 280 $PY $B --model qwen2.5-1.5b --head-remat 0 --unroll 28 --profile /tmp/p1 --json-out $OUT/upd_15b_unroll28_head0.json > $OUT/upd_15b_unroll28_head0.log 2>&1
  timeout 250 $PY $B --model qwen2.5-0.5b --head-remat 0 --unroll 24 --json-out $OUT/upd_05b_unroll24_head0.json > $OUT/upd_05b_unroll24_head0.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=0
  timeout 280 $PY $B --model qwen2.5-1.5b --head-remat 1 --unroll 28 --json-out $OUT/upd_15b_unroll28_head1.json > $OUT/upd_15b_unroll28_head1.log 2>&1
  timeout 250 $PY $B --model qwen2.5-1.5b --head-remat 0 --unroll 1 --json-out $OUT/upd_15b_unroll1_head0.json > $OUT/upd_15b_unroll1_head0.log 2>&1 ) &
wait
for f in $OUT/upd_*.log; do echo "== $f"; grep "by category" $f; tail -4 $f; done
