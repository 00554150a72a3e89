source docs/benchmarks/device/2026-11-30_common.sh
B="scripts/bench_update.py --model qwen2.5-1.5b --batch 8 --seq 1024 --steps 8 --remat dots_attn"
i=0
for V in "|" "--unroll 2|" "--unroll 4|" "|--xla_gpu_copy_insertion_use_region_analysis=true" "|--xla_gpu_enable_while_loop_double_buffering=true"; do
  A="${V%%|*}"; F="${V#*|}"; i=$((i+1))
  XLA_FLAGS="$F" timeout 100 $PY $B $A --no-torch --json-out $OUT/var$i.json > $OUT/var$i.log 2>&1
  echo "var$i [$A] [$F]: $(tail -1 $OUT/var$i.log)"
done
BEST=$($PY - <<'PY'
import json, glob, os
out = os.environ["OUT"]; variants = ["|", "--unroll 2|", "--unroll 4|", "|--xla_gpu_copy_insertion_use_region_analysis=true", "|--xla_gpu_enable_while_loop_double_buffering=true"]
best, tps = variants[0], 0
for i, v in enumerate(variants, 1):
    try: r = json.load(open(f"{out}/var{i}.json"))[0]["tokens_per_s"]
    except Exception: continue
    if r > tps: best, tps = v, r
print(best)
PY
)
echo "best: $BEST"; A="${BEST%%|*}"; F="${BEST#*|}"
XLA_FLAGS="$F" timeout 200 $PY $B $A --torch-ckpt 1 --json-out $OUT/final.json > $OUT/final.log 2>&1
tail -4 $OUT/final.log
