bash .gpukit/install.sh; source docs/benchmarks/device/2026-11-30_common.sh
( export CUDA_VISIBLE_DEVICES=1
  timeout 560 $PY scripts/bench_packing.py --model qwen2.5-0.5b,qwen2.5-1.5b --seqs 64 --micro 8 --budget 2048,4096,8192 --steps 3 \
    --json-out $OUT/bench_packing.json > $OUT/bench_packing.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=0
  B="scripts/bench_update.py --model qwen2.5-1.5b --batch 8 --seq 1024 --steps 8"
  timeout 250 $PY $B --remat dots --torch-ckpt 1 --json-out $OUT/upd_dots.json > $OUT/upd_dots.log 2>&1
  timeout 100 $PY $B --remat dots_attn --no-torch --profile /tmp/p1 --json-out $OUT/upd_dots_attn.json > $OUT/upd_dots_attn.log 2>&1
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 100 $PY $B --remat dots_attn --no-torch --profile /tmp/p2 --json-out $OUT/upd_dots_attn_notriton.json > $OUT/upd_dots_attn_notriton.log 2>&1
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 100 $PY $B --remat dots --no-torch --json-out $OUT/upd_dots_notriton.json > $OUT/upd_dots_notriton.log 2>&1
) &
wait
for f in $OUT/upd_*.log; do echo "== $f"; tail -4 $f; done; grep -h "window\|^model\|^qwen" $OUT/upd_dots_attn*.log; echo "== packing"; tail -16 $OUT/bench_packing.log
