#!/usr/bin/env bash
# One command for every verdict and figure the repo prints: experiment 05's claims (with the rest of 00 /
# 05's sections) and 00 / 05's figures and the refit benchmark's, 06's claims and figures, 07's ladder, grid,
# claims, power plan and registration timeline, all into results/RESULTS.md and results/figures/, each
# under its experiment's registered analysis (experiments/NN/analysis.yaml), then the READMEs' generated
# numbers. From unchanged runs it rewrites every file byte for byte. Notebook 08 computes the same tables
# when run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" scripts/write_results.py results/runs/00_tiny_moe_cpu results/runs/05_mismatch_consequences
"$PY" scripts/make_figures.py
"$PY" scripts/geometry_figures.py
"$PY" experiments/07_dose_threshold/report.py
"$PY" scripts/write_readme_numbers.py
