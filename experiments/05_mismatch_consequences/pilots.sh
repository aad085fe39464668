#!/usr/bin/env bash
# The pilot search (README.md, "Pilot search"): short runs, one at a time, one thread each.
# Usage: experiments/05_mismatch_consequences/pilots.sh NAME ARM STEPS [key=value ...]
# Output: runs/pilots/NAME (gitignored); the table is built by pilot_table.py.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
name=$1 arm=$2 steps=$3; shift 3
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python=${PYTHON:-.venv/bin/python}
exec "$python" scripts/run.py "experiments/05_mismatch_consequences/arms/$arm.yaml" --no-progress \
  "tracking.output_dir=runs/pilots/$name" "trainer.steps=$steps" trainer.eval_every=0 "$@"
