bash .gpukit/install.sh; source docs/benchmarks/device/2026-11-30_common.sh
timeout 560 $PY scripts/mesh_sweep.py --model qwen2.5-1.5b --meshes "single;data=2;fsdp=2,gather=update;fsdp=2" \
  --batch 16 --seq 1024 --steps 3 --micro-per-device 8 --profile /tmp/prof --json-out $OUT/mesh_sweep.json > $OUT/mesh_sweep.log 2>&1
tail -60 $OUT/mesh_sweep.log
