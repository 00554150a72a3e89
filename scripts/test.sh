#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the CPU test suite. Extra args go to pytest.
#   JAXPPO_TEST_WORKERS  pytest-xdist workers (default 2; 0 runs in this process; each test file stays on
#                        one worker, so module fixtures are built once; the files go out in the order
#                        tests/conftest.py gives them, longest first, not xdist's own by number of tests)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
# the suite starts ~100 small training runs of the same shapes: JAX's persistent cache keeps every program
# (jaxppo keeps those that took >= 2 s to compile), which saves each run a few seconds of compiling
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
exec python -m pytest -n "${JAXPPO_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
