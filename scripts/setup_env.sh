#!/usr/bin/env bash
# Create .venv (if absent) and install the pinned CPU stack. Idempotent: skips the install when
# requirements/cpu.txt and requirements/constraints.txt have not changed since the last successful one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.moerl-installed
want=$(cat requirements/cpu.txt requirements/constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] installing pinned requirements (torch==2.13.0 CPU first, then the rest under requirements/constraints.txt)"
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -r requirements/cpu.txt -c requirements/constraints.txt
.venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"expected torch 2.13.0, got {torch.__version__}"
PY
echo "$want" > "$stamp"
