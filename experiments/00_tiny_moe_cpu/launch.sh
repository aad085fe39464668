#!/usr/bin/env bash
# Experiment 00 on CPU. Usage:
#   experiments/00_tiny_moe_cpu/launch.sh                 # every arm x 3 seeds (resumable sweep)
#   experiments/00_tiny_moe_cpu/launch.sh r3 [--seed 1]   # one arm
# Runs go to runs/00_tiny_moe_cpu/ (gitignored); the recorded ablation in results/runs is not touched.
# The sweep gives each of its 2 parallel runs half of the cores this process may use.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
bash scripts/setup_env.sh
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ $# -eq 0 ]; then
  # Two processes share the cores: idle OpenMP threads must not spin.
  OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} exec .venv/bin/python scripts/sweep.py experiments/00_tiny_moe_cpu --seeds 3 --jobs 2
fi
# One run has the cores to itself: OpenMP's default wait (a short spin) is 1.9x faster than PASSIVE here.
arm=$1; shift
exec .venv/bin/python scripts/run.py "experiments/00_tiny_moe_cpu/arms/$arm.yaml" "$@"
