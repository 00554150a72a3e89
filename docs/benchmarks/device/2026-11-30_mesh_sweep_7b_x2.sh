source docs/benchmarks/device/2026-11-30_common.sh
timeout 520 $PY scripts/mesh_sweep.py --model qwen2.5-7b --meshes "fsdp=2;fsdp=2,gather=update" --batch 16 --seq 1024 --steps 2 \
  --micro-per-device 4 --remat dots_attn --actor-only --json-out $OUT/mesh_sweep_7b_x2.json > $OUT/mesh_sweep_7b_x2.log 2>&1
tail -8 $OUT/mesh_sweep_7b_x2.log
