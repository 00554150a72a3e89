source docs/benchmarks/device/2026-11-30_common.sh
timeout 240 $PY scripts/mesh_sweep.py --model qwen2.5-1.5b --meshes "single;data=2;data=2,reduce=bfloat16" \
  --batch 16 --seq 1024 --steps 3 --micro-per-device 8 --profile /tmp/prof --json-out $OUT/mesh_sweep_bf16.json > $OUT/mesh_sweep_bf16.log 2>&1
grep -A4 "^mesh " $OUT/mesh_sweep_bf16.log
( export CUDA_VISIBLE_DEVICES=1
  timeout 300 $PY scripts/bench_packing.py --model qwen2.5-0.5b,qwen2.5-1.5b --seqs 64 --micro 8 --budget 8192,16384 --steps 3 \
    --json-out $OUT/bench_packing2.json > $OUT/bench_packing2.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=0
  B="scripts/bench_update.py --model qwen2.5-1.5b --seq 1024 --steps 8 --remat dots_attn --torch-ckpt 1"
  timeout 160 $PY $B --batch 8 --json-out $OUT/upd_b8.json > $OUT/upd_b8.log 2>&1
  timeout 160 $PY $B --batch 16 --json-out $OUT/upd_b16.json > $OUT/upd_b16.log 2>&1
) &
wait
for f in $OUT/upd_b*.log; do echo "== $f"; tail -4 $f; done; echo "== packing"; tail -8 $OUT/bench_packing2.log
