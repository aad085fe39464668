#!/usr/bin/env bash
# Experiment 05 on CPU, one thread per run. Usage:
#   experiments/05_mismatch_consequences/launch.sh                 # every arm x 3 seeds (resumable sweep)
#   experiments/05_mismatch_consequences/launch.sh r3 [--seed 1]   # one arm
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ $# -eq 0 ]; then
  exec .venv/bin/python scripts/sweep.py experiments/05_mismatch_consequences --seeds 3 --jobs 2
fi
arm=$1; shift
exec .venv/bin/python scripts/run.py "experiments/05_mismatch_consequences/arms/$arm.yaml" "$@"
