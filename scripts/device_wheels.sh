#!/usr/bin/env bash
# The wheels the GPU checks install on a CUDA machine that may have no network (CPython 3.12, CUDA torch):
# requirements/device.txt (hashes pinned) into the git-ignored .whl/, to copy over with the checkout.
#
#     bash scripts/device_wheels.sh [DIR]     # here, where a registry is reachable (default DIR: .whl)
#
# Used by scripts/gpu_router_replay.sh (megatron-core, verl's replay path) and scripts/gpu_width_geometry.py
# (moerl's pins of transformers, peft, omegaconf, math-verify: the device's transformers is newer and it has
# no omegaconf or math-verify). $PYTHON: the Python whose pip downloads (default python3; any version, the
# wheels are chosen for CPython 3.12 manylinux x86_64). pip checks every download against its pinned hash;
# the one source distribution (antlr4's) is checked the same way, then built into a pure-Python wheel here.
# SHA256SUMS records what lies in DIR, so the GPU side verifies what arrived before installing it.
# Idempotent: downloads again only what is missing. On the device:
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$dir"
"$PY" -m pip download -q --no-deps --only-binary=:all: --require-hashes --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" -r requirements/device.txt
if ! ls "$dir"/antlr4_python3_runtime-4.9.3-py3-none-any.whl >/dev/null 2>&1; then
  "$PY" -m pip wheel -q --no-deps --require-hashes --no-build-isolation -w "$dir" -r requirements/device-sdist.txt
fi
# exactly one file per pinned name, nothing else (two versions of one package stop the offline install)
want=$(grep -hoE '^[A-Za-z0-9_.-]+==' requirements/device.txt requirements/device-sdist.txt | wc -l)
have=$(ls "$dir"/*.whl | wc -l)
if [ "$want" != "$have" ]; then
  echo "[device-wheels] error: $dir holds $have wheels, requirements/device*.txt pin $want: empty $dir and rerun" >&2
  exit 2
fi
(cd "$dir" && sha256sum ./*.whl > SHA256SUMS)
echo "[device-wheels] $have wheels, $(du -sh "$dir" | cut -f1) in $dir (carry it: \"$dir\")"
