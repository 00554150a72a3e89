source docs/benchmarks/device/2026-11-30_common.sh
M=docs/benchmarks/device/2026-11-30_memory_plan_forward.py
timeout 120 $PY $M qwen2.5-1.5b "{'fsdp':2}" layer 2>&1 | grep -v "^W\|^I" | tail -2
timeout 150 $PY $M qwen2.5-7b "{'fsdp':2}" layer 2>&1 | grep -v "^W\|^I" | tail -2
XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=false timeout 150 $PY $M qwen2.5-7b "{'fsdp':2}" layer 2>&1 | grep -v "^W\|^I" | tail -2
XLA_FLAGS=--xla_gpu_enable_while_loop_double_buffering=false timeout 150 $PY $M qwen2.5-7b "{'fsdp':2}" layer 2>&1 | grep -v "^W\|^I" | tail -2
