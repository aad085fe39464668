#!/usr/bin/env bash
# Resolve requirements/gpu.txt with pip's resolver for the cluster (CPython 3.12, Linux x86_64,
# glibc >= 2.31) without installing anything: any machine with pip and network access can run it.
#   scripts/resolve_gpu_requirements.sh [report.json]
# pip does not expand an explicit --platform to older manylinux tags, so every tag is listed.
# The packages built from source on the node (requirements/gpu.txt header) are not part of this.
# Pure-Python dependencies that exist only as sdists (hydra-core's antlr4-python3-runtime==4.9.*)
# are built to a py3-none-any wheel first: --platform forbids sdists, and such a wheel is the same
# on every platform (on the node pip builds it the same way).
set -euo pipefail
cd "$(dirname "$0")/.."
report="${1:-/tmp/moerl-gpu-resolve.json}"
wheels="$(mktemp -d)"
python -m pip wheel --no-deps -q -w "$wheels" "antlr4-python3-runtime==4.9.3"
plat=()
for minor in $(seq 39 -1 17); do plat+=(--platform "manylinux_2_${minor}_x86_64"); done
python -m pip install --dry-run --ignore-installed --no-cache-dir --python-version 3.12 "${plat[@]}" \
    --platform manylinux2014_x86_64 --only-binary=:all: --find-links "$wheels" -r requirements/gpu.txt \
    --report "$report"
echo "resolved: $report"
