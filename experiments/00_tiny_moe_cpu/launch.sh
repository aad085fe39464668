#!/usr/bin/env bash
# Experiment 00 on CPU. Usage:
#   experiments/00_tiny_moe_cpu/launch.sh [key=value ...]             # every arm x 3 seeds (resumable sweep)
#   experiments/00_tiny_moe_cpu/launch.sh r3 [--seed 1] [key=value ...]  # one arm
#   experiments/00_tiny_moe_cpu/launch.sh --smoke [ARM]               # two tiny steps (under 2 min)
# Runs go to runs/00_tiny_moe_cpu/ (gitignored); --record writes the recorded ablation in results/runs,
# --out DIR elsewhere. Sweep options (--arms, --seeds, --jobs, --dry-run) pass through to scripts/sweep.py.
# The sweep gives each of its 2 parallel runs half of the cores this process may use.
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
source scripts/launch_common.sh
exp=experiments/00_tiny_moe_cpu
if [ "$SMOKE" = 1 ]; then
  exec "$PY" scripts/run.py "$exp/arms/${ARM:-baseline}.yaml" --fresh --no-progress "tracking.output_dir=$RUNS" \
    "${SMOKE_OVERRIDES[@]}" "${REST[@]+"${REST[@]}"}"
fi
if [ -z "$ARM" ]; then
  # Two processes share the cores: idle OpenMP threads must not spin.
  OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} exec "$PY" scripts/sweep.py "$exp" --seeds 3 --jobs 2 \
    --output-dir "$RUNS" "${REST[@]+"${REST[@]}"}"
fi
# One run has the cores to itself: OpenMP's default wait (a short spin) is 1.9x faster than PASSIVE here.
exec "$PY" scripts/run.py "$exp/arms/$ARM.yaml" "tracking.output_dir=$RUNS" "${REST[@]+"${REST[@]}"}"
