#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the CPU test suite. Extra args go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec python -m pytest "$@"
