#!/usr/bin/env bash
# Build the optional environment at the cluster's pins: a Python 3.12 venv with megatron-core 0.19.2
# (the version requirements/gpu.txt pins), verl 0.9.1 and PyPI's torch 2.13.0 for cp312 (a CUDA build
# that runs on CPU). `scripts/test_upstream.sh mcore` runs tests/upstream in it.
#   $MOERL_MCORE_VENV   the venv (default: .venv-mcore in the repo root)
#   $PYTHON             a Python 3.12 interpreter (default: python3.12 on PATH, else pyenv's 3.12)
# Idempotent: skips the install when requirements/upstream-mcore.txt and requirements/constraints.txt are unchanged.
# Not part of .ci/run: it downloads ~4.6 GB (torch's CUDA wheels) and fills 4.7 GB of disk; measured on a
# 2-core machine: docs/cluster.md ("Upstream code at the cluster's pins").
# (scripts/setup_upstream_mcore.sh is a different, lighter thing: it unpacks the 0.19.2 wheel for the
# pure-Python constraint checks of tests/verl_ext/test_constraints.py under the main 3.11 venv.)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MOERL_MCORE_VENV:-$PWD/.venv-mcore}
REQ=requirements/upstream-mcore.txt
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  # (a pyenv shim named python3.12 exists even where 3.12 is not an active version: run it to know)
  if python3.12 -c '' >/dev/null 2>&1; then
    PY=python3.12
  elif command -v pyenv >/dev/null && ls -d "$(pyenv root)"/versions/3.12.*/bin/python >/dev/null 2>&1; then
    PY=$(ls -d "$(pyenv root)"/versions/3.12.*/bin/python | tail -1)
  else
    echo "[setup-mcore] error: no Python 3.12 found (megatron-core 0.19.2 is published for CPython 3.12 only); set PYTHON" >&2
    exit 2
  fi
fi
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' 2>/dev/null || {
  echo "[setup-mcore] error: $PY is not Python 3.12 (megatron-core 0.19.2 is published for CPython 3.12 only)" >&2
  exit 2; }
want_mcore=$(sed -n 's/^megatron-core==//p' requirements/gpu.txt)
have_mcore=$(sed -n 's/^megatron-core==//p' "$REQ")
if [ "$want_mcore" != "$have_mcore" ]; then
  echo "[setup-mcore] error: $REQ pins megatron-core $have_mcore but requirements/gpu.txt pins $want_mcore" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-mcore] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.moerl-mcore-installed
want=$(cat "$REQ" requirements/constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup-mcore] installing $REQ into $VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned (the cp312 build from PyPI; the local cp311 CPU wheel does not apply)
"$VENV/bin/python" -m pip install -q "$(grep '^torch==' "$REQ")"
grep -v '^verl==' "$REQ" > "$VENV/.requirements-resolved.txt"
"$VENV/bin/python" -m pip install -q -r "$VENV/.requirements-resolved.txt" -c requirements/constraints.txt
"$VENV/bin/python" -m pip install -q --no-deps "$(grep '^verl==' "$REQ")"
"$VENV/bin/python" - "$want_mcore" <<'PY'
import sys
import megatron.core, torch, verl.utils.megatron.router_replay_patch  # noqa: F401  (the patch imports)
from importlib.metadata import version
assert version("megatron-core") == sys.argv[1], f"expected megatron-core {sys.argv[1]}, got {version('megatron-core')}"
assert torch.__version__.startswith("2.13.0"), f"expected torch 2.13.0, got {torch.__version__}"
print(f"[setup-mcore] megatron-core {version('megatron-core')}, verl {version('verl')}, torch {torch.__version__}")
PY
echo "$want" > "$stamp"
