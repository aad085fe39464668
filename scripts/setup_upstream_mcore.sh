#!/usr/bin/env bash
# Optional: the cluster's pinned Megatron-Core (0.19.2, published for CPython 3.12 only) unpacked
# next to this Python so tests/verl_ext/test_constraints.py also runs the constraint layer's
# Megatron rules under 0.19.2 (the main environment has 0.16.1, the newest wheel for Python 3.11).
#   scripts/setup_upstream_mcore.sh [DIR]      (default: /tmp/moerl-upstream-mcore)
#   MOERL_UPSTREAM_MCORE=DIR pytest tests/verl_ext/test_constraints.py
# The wheel is unpacked, not installed: its pure-Python config and layer-distribution code runs on
# 3.11; its one compiled helper (datasets/helpers_cpp, cp312) is never imported by these rules.
# Megatron-Core 0.19.2 imports triton at start-up, so triton is unpacked beside it (no GPU needed).
set -euo pipefail
dir="${1:-/tmp/moerl-upstream-mcore}"
mkdir -p "$dir/wheels"
python -m pip download --no-deps -q -d "$dir/wheels" megatron-core==0.19.2 --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --only-binary=:all:
python -m pip install --no-deps -q --target "$dir/site" triton==3.6.0
python - "$dir" <<'PY'
import sys, zipfile, glob
d = sys.argv[1]
zipfile.ZipFile(glob.glob(f"{d}/wheels/megatron_core-0.19.2-*.whl")[0]).extractall(f"{d}/site")
PY
echo "MOERL_UPSTREAM_MCORE=$dir/site"
