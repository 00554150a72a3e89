source docs/benchmarks/device/2026-11-30_common.sh
timeout 300 $PY scripts/mesh_sweep.py --model qwen2.5-0.5b --meshes "single;data=2;fsdp=2;tensor=2" --batch 16 --seq 1024 --steps 2 \
  --micro-per-device 8 --json-out $OUT/mesh_sweep_05b.json > $OUT/mesh_sweep_05b.log 2>&1
timeout 250 $PY scripts/bench_packing.py --model qwen2.5-0.5b --seqs 64 --micro 8 --budget 8192 --steps 3 --check \
  --json-out $OUT/pack_x2.json > $OUT/pack_x2.log 2>&1
tail -12 $OUT/mesh_sweep_05b.log; grep -v "^{\"model" $OUT/pack_x2.log | tail -12
