source docs/benchmarks/device/2026-11-30_common.sh
( export CUDA_VISIBLE_DEVICES=0
  timeout 300 $PY scripts/bench_packing.py --model qwen2.5-0.5b,qwen2.5-1.5b --seqs 64 --micro 8 --budget 8192 --steps 5 \
    --json-out $OUT/pack.json > $OUT/pack.log 2>&1
  timeout 250 $PY scripts/bench_packing.py --model qwen2.5-1.5b --seqs 64 --micro 8 --budget 8192 --steps 5 --remat dots_attn \
    --json-out $OUT/pack_dots_attn.json > $OUT/pack_dots_attn.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  B="scripts/bench_update.py --model qwen2.5-1.5b --batch 8 --seq 1024 --steps 8 --remat dots_attn"
  timeout 250 $PY $B --head-remat 0 --json-out $OUT/upd_head0.json > $OUT/upd_head0.log 2>&1
  timeout 250 $PY $B --head-remat 1 --json-out $OUT/upd_head1.json > $OUT/upd_head1.log 2>&1 ) &
wait
tail -6 $OUT/pack.log; tail -3 $OUT/pack_dots_attn.log; tail -5 $OUT/upd_head0.log; tail -5 $OUT/upd_head1.log
