source docs/benchmarks/device/2026-11-30_common.sh
$PY -c "import jax; from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version; print('cudnn', check_cudnn_version(), jax.__version__)"
( export CUDA_VISIBLE_DEVICES=0
  timeout 570 $PY scripts/bench_packing.py --model qwen2.5-0.5b --seqs 64 --micro 8 --budget 8192 --steps 5 \
    --attention cudnn,cudnn_mask --check --json-out $OUT/pack_05b.json > $OUT/pack_05b.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 330 $PY scripts/bench_packing.py --model qwen2.5-1.5b --seqs 64 --micro 8 --budget 8192 --steps 5 \
    --attention cudnn,cudnn_mask --json-out $OUT/pack_15b.json > $OUT/pack_15b.log 2>&1
  timeout 200 $PY scripts/bench_update.py --model qwen2.5-1.5b --batch 8 --seq 1024 --steps 8 --remat dots_attn --no-torch \
    --profile /tmp/p1 --json-out $OUT/upd.json > $OUT/upd.log 2>&1 ) &
wait
grep -v "^{" $OUT/pack_05b.log | tail -30; grep "check" $OUT/pack_05b.log; tail -8 $OUT/pack_15b.log; head -50 $OUT/upd.log
