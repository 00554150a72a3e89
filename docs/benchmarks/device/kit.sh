#!/usr/bin/env bash
# Here (not on the device), from the repo root of a fresh checkout: what the device queue carries besides the tree.
#   bash docs/benchmarks/device/kit.sh
# - .whl/: the wheels of jaxppo's dependencies the device image lacks (../shared/gpu/README.md lists them;
#   math-verify with its latex2sympy2_extended since the \boxed{} reward), installed there by the queue's `start`
#   into /tmp/whl.
# - .gpukit/: vLLM's kit (../shared/gpu/build-kit.sh), its parts cut again so that each part travels with the
#   working tree under a call's 64 MiB (the tree alone is ~22 MiB: the kit's own 55 MiB parts do not fit beside it).
# Then the calls, back to back (the machine goes back after 30 s idle): the first carries .gpukit/install.sh,
# .gpukit/MANIFEST, the last (small) part and .whl, and starts the queue; each further call carries install.sh,
# MANIFEST and one part and runs `bash .gpukit/install.sh` (exit 3 until the last part has come).
set -euo pipefail
cd "$(dirname "$0")/../../.."
mkdir -p .whl
python3 -m pip download -q --no-deps -d .whl omegaconf==2.3.0 jaxtyping wadler_lindig tensorboardX rich \
    markdown-it-py mdurl math-verify latex2sympy2_extended
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # an sdist only: built here
bash ../shared/gpu/build-kit.sh
tree_mib=$(( $(git ls-files -z | du -c --files0-from=- -b | tail -1 | cut -f1) / 1048576 + 1 ))
part_mib=$(( 62 - tree_mib ))
cd .gpukit
cat part.* > ../.gpukit.all && rm part.*
split -b "${part_mib}M" -d ../.gpukit.all part. && rm ../.gpukit.all
sha256sum part.* > MANIFEST
echo "tree ${tree_mib} MiB; kit parts of ${part_mib} MiB:"; ls -l part.*
