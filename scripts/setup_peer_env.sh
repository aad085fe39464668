#!/usr/bin/env bash
# Build the optional environment that runs TRL's GRPOTrainer next to moerl's (benchmarks/bench_peer.py).
# The venv lives at $MOERL_PEER_VENV (default: .venv-peer in the repo root): the main requirements,
# moerl itself (editable) and requirements/peer.txt, all under requirements/constraints.txt so the CPU torch stays.
# Idempotent: skips the install when the requirement files have not changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MOERL_PEER_VENV:-$PWD/.venv-peer}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-peer] creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.moerl-peer-installed
want=$(cat requirements/cpu.txt requirements/peer.txt requirements/constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup-peer] installing requirements/cpu.txt + requirements/peer.txt into $VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -r requirements/cpu.txt -r requirements/peer.txt -c requirements/constraints.txt
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" - <<'PY'
import peft, torch, transformers, trl
assert torch.__version__.startswith("2.13.0"), f"expected torch 2.13.0, got {torch.__version__}"
print(f"[setup-peer] trl {trl.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
      f"torch {torch.__version__}")
PY
echo "$want" > "$stamp"
