#!/usr/bin/env bash
# The main job on the embedded default: sets up .venv if needed, then `python -m jaxppo.train` (CPU,
# synthetic arithmetic task, tiny model). Extra args are config overrides (key=value) or --config FILE.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec python -m jaxppo.train "$@"
