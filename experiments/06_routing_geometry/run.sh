#!/usr/bin/env bash
# Experiment 06 on CPU, one thread, one point at a time: measure every ladder point that has no
# finished JSON under results/geometry (resumable), then the figures and the RESULTS section.
#   experiments/06_routing_geometry/run.sh            # everything
#   experiments/06_routing_geometry/run.sh --commit   # git-commit each point's JSON as it lands
#   experiments/06_routing_geometry/run.sh --only depth
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
.venv/bin/python scripts/measure_geometry.py "$@"
.venv/bin/python scripts/geometry_figures.py
