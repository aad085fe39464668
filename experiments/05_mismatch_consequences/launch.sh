#!/usr/bin/env bash
# Experiment 05 on CPU, one thread per run. Usage:
#   experiments/05_mismatch_consequences/launch.sh [key=value ...]              # every arm x 3 seeds (resumable sweep)
#   experiments/05_mismatch_consequences/launch.sh r3 [--seed 1] [key=value ...]  # one arm
#   experiments/05_mismatch_consequences/launch.sh --smoke [ARM]                # two tiny steps (under 2 min)
# Runs go to runs/05_mismatch_consequences/ (gitignored); --record writes the recorded runs in results/runs,
# --out DIR elsewhere. Sweep options (--arms, --seeds, --jobs, --dry-run) pass through to scripts/sweep.py.
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
source scripts/launch_common.sh
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
exp=experiments/05_mismatch_consequences
if [ "$SMOKE" = 1 ]; then
  exec "$PY" scripts/run.py "$exp/arms/${ARM:-baseline}.yaml" --fresh --no-progress "tracking.output_dir=$RUNS" \
    "${SMOKE_OVERRIDES[@]}" "${REST[@]+"${REST[@]}"}"
fi
if [ -z "$ARM" ]; then
  exec "$PY" scripts/sweep.py "$exp" --seeds 3 --jobs 2 --output-dir "$RUNS" "${REST[@]+"${REST[@]}"}"
fi
exec "$PY" scripts/run.py "$exp/arms/$ARM.yaml" "tracking.output_dir=$RUNS" "${REST[@]+"${REST[@]}"}"
