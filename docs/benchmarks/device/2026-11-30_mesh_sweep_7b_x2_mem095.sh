source docs/benchmarks/device/2026-11-30_common.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
timeout 270 $PY scripts/mesh_sweep.py --model qwen2.5-7b --meshes "fsdp=2" --batch 16 --seq 1024 --steps 2 \
  --micro-per-device 4 --remat dots_attn --actor-only --json-out $OUT/mesh_sweep_7b_x2.json > $OUT/mesh_sweep_7b_x2.log 2>&1
grep -v "^W\|^I\|^  " $OUT/mesh_sweep_7b_x2.log | tail -4 | cut -c1-600
