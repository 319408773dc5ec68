#!/usr/bin/env bash
# The release slice (tests/test_release_slice.py: the demo, TP+SP, PP, MoE and the distributed
# optimizer, each clean and with one injected bug; tests/test_hybrid.py's HybridModel runs on releases
# that have it) on another megatron-core release than the one
# installed: it is installed into a directory of its own, put first on PYTHONPATH, and the slice
# runs there. megatron-core 0.17 on declares Python >= 3.12, whose CPU torch this machine's
# registries do not carry; its code runs on Python 3.11 (0.18 on import triton, which installs
# without a GPU), hence --ignore-requires-python.
#   bash .ci/release_slice.sh 'megatron-core==0.19.*'
set -euo pipefail
cd "$(dirname "$0")/.."
spec="$1"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
python3 -m pip install -q --no-deps --ignore-requires-python --target "$dir" "$spec" 'triton==3.9.0'
PYTHONPATH="$dir" python3 -m pytest -m release_slice -p no:cacheprovider
