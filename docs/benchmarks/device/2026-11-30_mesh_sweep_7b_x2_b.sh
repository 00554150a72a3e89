source docs/benchmarks/device/2026-11-30_common.sh
timeout 100 $PY docs/benchmarks/device/2026-11-30_memory_plan_update.py qwen2.5-7b "{'fsdp':2}" layer 4 2>&1 | grep -v "^W\|^I\|^  " | tail -2
timeout 200 $PY scripts/mesh_sweep.py --model qwen2.5-7b --meshes "fsdp=2" --batch 16 --seq 1024 --steps 2 \
  --micro-per-device 4 --remat dots_attn --actor-only --json-out $OUT/mesh_sweep_7b_x2.json > $OUT/mesh_sweep_7b_x2.log 2>&1
tail -3 $OUT/mesh_sweep_7b_x2.log | cut -c1-400
timeout 220 $PY scripts/mesh_sweep.py --model qwen2.5-1.5b --meshes "single;fsdp=2;fsdp=2,gather=update;data=2" --batch 16 --seq 1024 \
  --steps 3 --micro-per-device 8 --json-out $OUT/mesh_sweep_15b_x2.json > $OUT/mesh_sweep_15b_x2.log 2>&1
tail -6 $OUT/mesh_sweep_15b_x2.log
