#!/usr/bin/env bash
# The prepared GPU check: verl 0.9.1's Router Replay on megatron-core 0.19.2 (tests/upstream/
# test_megatron_router_replay.py) on one CUDA device, reported as OUT_DIR/router_replay.{json,png,log}.
#   MOERL_TEST_DEVICE=cuda bash scripts/gpu_router_replay.sh OUT_DIR     (on the GPU machine)
#   MOERL_TEST_DEVICE=cpu  bash scripts/gpu_router_replay.sh OUT_DIR     (the same steps on the CPU)
# OUT_DIR: new or empty (a report there is never overwritten).
# First, where a registry is reachable: bash scripts/device_wheels.sh (fills .whl/, carried).
# Steps: verify .whl against its SHA256SUMS; install them offline (pip --no-index --no-deps) into
# a --target folder put first on PYTHONPATH, over the machine's Python (its CUDA torch, matplotlib; a
# venv made from that Python, itself a venv, would not see its packages); run the tests (run step);
# draw the figure (plot step).
#   cuda: $PYTHON (default python3, the machine's) does everything.
#   cpu:  $MOERL_MCORE_VENV (default .venv-mcore, scripts/setup_upstream_mcore_venv.sh) runs the tests,
#         $MOERL_PLOT_PYTHON (default .venv/bin/python, which has matplotlib) draws.
# The whole script stops after $MOERL_GPU_CHECK_LIMIT_S seconds (default 300; the CPU rehearsal takes
# about 40 s here); the JSON written so far (rewritten after each test) and the log remain.
set -euo pipefail
out=$(realpath -m "${1:?usage: MOERL_TEST_DEVICE=cuda|cpu bash scripts/gpu_router_replay.sh OUT_DIR}")
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$self")/.."
if [ -z "${MOERL_GPU_CHECK_GUARDED:-}" ]; then
  MOERL_GPU_CHECK_GUARDED=1 exec timeout -k 10 "${MOERL_GPU_CHECK_LIMIT_S:-300}" bash "$self" "$out"
fi
device=${MOERL_TEST_DEVICE:-cuda}
wheels=${MOERL_GPU_WHEELS:-.whl}
case "$device" in
  cuda) PY=${PYTHON:-python3}; PLOT_PY=$PY ;;
  cpu)  PY=${MOERL_MCORE_VENV:-$PWD/.venv-mcore}/bin/python; PLOT_PY=${MOERL_PLOT_PYTHON:-$PWD/.venv/bin/python} ;;
  *) echo "[gpu-router-replay] error: MOERL_TEST_DEVICE=$device: expected cuda or cpu" >&2; exit 2 ;;
esac
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null || {
  echo "[gpu-router-replay] error: $PY is not Python 3.12 (megatron-core 0.19.2 is published for CPython 3.12 only)" >&2
  exit 2; }
# refuse before anything is written or installed (the run step checks the same again)
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null || [ "$device" = cpu ] || {
  echo "[gpu-router-replay] error: MOERL_TEST_DEVICE=cuda but $PY's torch sees no CUDA device; use MOERL_TEST_DEVICE=cpu to rehearse" >&2
  exit 2; }
[ -f "$wheels/SHA256SUMS" ] || {
  echo "[gpu-router-replay] error: $wheels/SHA256SUMS missing: run scripts/device_wheels.sh where a package index is reachable, and copy $wheels here" >&2
  exit 2; }
[ -e "$out/router_replay.json" ] && {
  echo "[gpu-router-replay] error: $out/router_replay.json exists: give an empty OUT_DIR (nothing is overwritten)" >&2
  exit 2; }
mkdir -p "$out"
log=$out/router_replay.log
(cd "$wheels" && sha256sum --quiet -c SHA256SUMS) || {
  echo "[gpu-router-replay] error: $wheels does not match its SHA256SUMS (a broken transfer?)" >&2; exit 2; }
site=$(mktemp -d "${TMPDIR:-/tmp}/moerl-gpu-site.XXXXXX")
trap 'rm -rf "$site"' EXIT
set -o pipefail
{
  echo "[gpu-router-replay] $(date -u +%FT%TZ) device=$device python=$PY"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
  export PYTHONPATH=$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  rc=0
  "$PY" scripts/gpu_router_replay.py run --device "$device" --out "$out" || rc=$?
  PYTHONPATH=$PWD/src "$PLOT_PY" scripts/gpu_router_replay.py plot "$out/router_replay.json"
  exit $rc
} 2>&1 | tee "$log"
