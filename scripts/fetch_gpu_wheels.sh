#!/usr/bin/env bash
# Download the wheels the prepared GPU check carries (requirements-gpu-check*.txt, hashes pinned) into an
# ignored folder that a device call names in `carry`:
#   scripts/fetch_gpu_wheels.sh [DIR]     (default: .gpu_wheels; ~19 MB)
#   $PYTHON   the Python whose pip downloads (default: python3); any version: the wheels are chosen for
#             CPython 3.12 manylinux x86_64, the GPU machine's Python.
# pip checks every download against its pinned hash. The one source distribution (antlr4's) is checked
# the same way, then built into a pure-Python wheel here. SHA256SUMS records what lies in DIR, so the
# GPU side verifies what arrived before installing it (scripts/gpu_router_replay.sh).
# Idempotent: downloads again only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu_wheels}
PY=${PYTHON:-python3}
mkdir -p "$dir"
"$PY" -m pip download -q --no-deps --only-binary=:all: --require-hashes --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" -r requirements-gpu-check.txt
if ! ls "$dir"/antlr4_python3_runtime-4.9.3-py3-none-any.whl >/dev/null 2>&1; then
  "$PY" -m pip wheel -q --no-deps --require-hashes --no-build-isolation -w "$dir" -r requirements-gpu-check-sdist.txt
fi
# exactly one file per pinned name, nothing else (two versions of one package stop the offline install)
want=$(grep -hoE '^[A-Za-z0-9_.-]+==' requirements-gpu-check.txt requirements-gpu-check-sdist.txt | wc -l)
have=$(ls "$dir"/*.whl | wc -l)
if [ "$want" != "$have" ]; then
  echo "[fetch-gpu-wheels] error: $dir holds $have wheels, requirements-gpu-check*.txt pin $want: empty $dir and rerun" >&2
  exit 2
fi
(cd "$dir" && sha256sum ./*.whl > SHA256SUMS)
echo "[fetch-gpu-wheels] $have wheels, $(du -sh "$dir" | cut -f1) in $dir (carry it: \"$dir\")"
