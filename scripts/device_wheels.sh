#!/usr/bin/env bash
# The wheels a lent GPU machine needs to run scripts/gpu_width_geometry.py, saved to .whl/ (git-ignored).
#
#     bash scripts/device_wheels.sh        # here, with network; then carry .whl with the device call
#
# The device machine has Python 3.12 with torch (CUDA), peft, accelerate, tokenizers, huggingface_hub,
# numpy, scipy, pandas, matplotlib, psutil, xxhash and PyYAML, and no network. It lacks omegaconf
# (moerl.config), math-verify (moerl.reward, imported by the trainer) and their antlr4 runtime, and its
# transformers is newer than the repo's pin (moerl.models.experts uses transformers' grouped-experts
# internals): the pins below are requirements.txt's (tests/analysis/test_gpu_width_geometry.py checks
# that they agree), tokenizers is the newest that transformers 5.10.4 accepts. Installed on the device with
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .whl
mkdir -p .whl
PURE="transformers==5.10.4 peft==0.21.2 omegaconf==2.3.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0"
BINARY="tokenizers==0.22.2"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $PURE $BINARY
# omegaconf pins antlr4-python3-runtime 4.9.*, published as a source archive only: built here (pure Python).
"$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -l .whl
du -sh .whl
