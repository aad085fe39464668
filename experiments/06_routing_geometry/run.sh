#!/usr/bin/env bash
# Experiment 06 on CPU, one thread, one point at a time: measure every ladder point that has no finished
# JSON in the output (resumable), then draw the figures and the RESULTS section from that same output.
#   experiments/06_routing_geometry/run.sh [--only depth] [key=value ...]   # into runs/geometry
#   experiments/06_routing_geometry/run.sh --record [--commit]              # into results/geometry (+ results/
#                                                                           # figures, RESULTS.md); --commit: git-commit
#                                                                           # each point's JSON as it lands
#   experiments/06_routing_geometry/run.sh --out DIR                        # into DIR (figures in DIR/figures)
#   experiments/06_routing_geometry/run.sh --smoke                          # two tiny points (under 2 min), no figures
# key=value overrides apply to base.yaml before each point sets its geometry.
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
source scripts/launch_common.sh
export OMP_NUM_THREADS=1
if [ "$RECORD" = 1 ]; then
  out=results/geometry figures=(--figures results/figures --results results/RESULTS.md)
else
  out=${OUT:-runs}/geometry
  [ "$SMOKE" = 1 ] && out=${OUT:-runs}/smoke/geometry
  figures=(--figures "$out/figures" --results "$out/RESULTS.md")
fi
args=("${ARGS[@]+"${ARGS[@]}"}")
[ "$SMOKE" = 1 ] && args+=(--smoke)
"$PY" scripts/measure_geometry.py --out "$out" "${args[@]+"${args[@]}"}"
# Two smoke points are no ladder: the fit and figures need the full grid.
[ "$SMOKE" = 1 ] && { echo "smoke: measured $out (figures are drawn from the full ladder only)"; exit 0; }
"$PY" scripts/geometry_figures.py --points "$out" "${figures[@]}"
