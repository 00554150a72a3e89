# Device calls (one H200) for LoRA (7b and 1.5b run on 2026-12-01: ledger `ppo_step`, docs/benchmarks.md "LoRA"; update not yet run).
# Usage, from the repo root there:  bash docs/benchmarks/device/2026-12-01_lora.sh <part>
#   7b       Qwen2.5-7B shape, GRPO n = 4, LoRA r = 64, in-process vLLM, 64 prompts x 256 tokens, 10 steps
#            (configs/gsm8k_qwen2.5_7b_lora.yaml): step breakdown, push time (timing_s/sync), memory per component
#   1.5b     configs/gsm8k_qwen2.5_1.5b.yaml as committed, then with LoRA r = 64 on actor and critic, same call
#   update   actor update 1.5B and 7B: JAX full fine-tuning beside JAX LoRA r = 64 (state, peak memory, step time)
# Each writes its ledger rows to $OUT/results_<part>.jsonl (append them with scripts/ledger.py --append).
set -u
part=$1
# the device copy's .git can be older than the commit being run (seen 2026-12-01): name it
: "${JAXPPO_COMMIT:?set JAXPPO_COMMIT to the commit under test (git rev-parse --short HEAD here)}"
export JAXPPO_COMMIT PY=/opt/torch/.venv/bin/python3
mkdir -p /tmp/whl && $PY -m pip install -q --no-index --no-deps --upgrade --target /tmp/whl .whl/*.whl
export PYTHONPATH=/tmp/site:/tmp/whl:. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
led=$OUT/results_$part.jsonl
case $part in
  7b)
    $PY scripts/bench_ppo_step.py --config configs/gsm8k_qwen2.5_7b_lora.yaml --shape qwen2.5-7b --steps 10 \
      --json-out $OUT/step_7b_lora.json --ledger $led 2>&1 | tee $OUT/step_7b_lora.log | grep -v '^{' ;;
  1.5b)
    for extra in "" "actor.lora_rank=64 actor.lora_alpha=128 critic.lora_rank=64 critic.lora_alpha=128"; do
      tag=$([ -z "$extra" ] && echo full || echo lora)
      $PY scripts/bench_ppo_step.py --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 \
        --json-out $OUT/step_1.5b_$tag.json --ledger $led $extra 2>&1 | tee $OUT/step_1.5b_$tag.log | grep -v '^{'
    done ;;
  update)
    $PY scripts/bench_update.py --model qwen2.5-1.5b,qwen2.5-7b --batch 8 --seq 1024 --steps 10 --remat dots_attn \
      --unroll 0 --head-remat 0 --torch "" --lora 64 --ledger $led 2>&1 | tee $OUT/update_lora.log ;;
esac
