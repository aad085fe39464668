#!/usr/bin/env bash
# Experiment 07, resumable (finished runs are skipped, interrupted ones resumed; commit results/ as runs land).
#   launch.sh pilot               the ladder: the uncorrected arm at every rung + the fp32 control, seed 0
#   launch.sh main RUNG [BELOW]   every mitigation arm, 3 seeds, at the threshold rung and the rung below
#   launch.sh control             the fp32 control on 3 seeds (the regime's "control learns" check)
# One thread per run, JOBS runs at a time (default 2 on 2 cores). Output: results/runs/07_dose_threshold/.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
JOBS=${JOBS:-2}
OUT=${OUT:-results/runs}
sweep() { "$PY" scripts/sweep.py experiments/07_dose_threshold --jobs "${JOBS}" --threads 1 --output-dir "$OUT" "$@"; }
case "${1:-}" in
  pilot)
    # One sweep per rung (a rung is an override): JOBS of them at a time, one run each.
    pilot=("--arms fp32_control --seeds 1")
    for rung in bf16 int8 fp8 nvfp4 int4; do pilot+=("--arms baseline --seeds 1 rollout.dtype=$rung"); done
    for ((i = 0; i < ${#pilot[@]}; i += JOBS)); do
      for args in "${pilot[@]:i:JOBS}"; do JOBS=1 sweep $args & done
      wait
    done ;;
  control)
    sweep --arms fp32_control --seeds 3 ;;
  main)
    [[ $# -ge 2 ]] || { echo "usage: launch.sh main RUNG [BELOW]" >&2; exit 2; }
    sweep --arms fp32_control --seeds 3
    for rung in "${@:2}"; do
      sweep --arms baseline,r3,tis,r3_tis,icepop,mis --seeds 3 "rollout.dtype=$rung"  # the claims' arms first
    done ;;
  *) echo "usage: launch.sh pilot | control | main RUNG [BELOW]" >&2; exit 2 ;;
esac
