bash .gpukit/install.sh && source docs/benchmarks/device/2026-11-30_common.sh && \
timeout 560 $PY -m jaxppo.launch --nproc 2 --script scripts/bench_ppo_step.py -- --config configs/gsm8k_qwen2.5_1.5b.yaml \
  --shape qwen2.5-1.5b --steps 3 --json-out $OUT/ppo_step_x2_piecewise.json mesh.data=2 rollout.cudagraph_mode=PIECEWISE \
  > $OUT/ppo_step_x2_piecewise.log 2>&1
tail -40 $OUT/ppo_step_x2_piecewise.log
