#!/usr/bin/env bash
# The main job: experiment 00 (LoRA GRPO on a tiny Qwen3-MoE) on CPU, end to end.
#   - sets up .venv (pinned CPU stack) if needed
#   - warm start: reuses the committed checkpoint (or trains it, ~5 min on 2 cores)
#   - runs the arms below for one seed; finished runs are skipped, interrupted ones resumed
#   - writes results/reproduce/00_tiny_moe_cpu/<arm>/seed0/ and results/reproduce/figures/*.png and
#     prints a table (the recorded 3-seed ablation lives apart, in results/runs and results/figures)
#   - compares each arm's run with the recorded run (scripts/check_reproducible.py --run) and says which check
#     applied: on the CPU kind that recorded it (machine.json: CPU model and ISA flags), one thread, as the
#     recorded runs were made, reproduces it bit for bit (in fp32 the thread count sets the reduction order,
#     so OMP_NUM_THREADS=2 gives another trajectory); on another CPU kind the emulated bf16 kernels round at
#     the same points but the fp32 products they round differ in their last bits, so the run is judged
#     statistically against the recorded seeds' spread
#   - exits 1 when the applicable check fails for any arm (2 when one cannot be judged)
# Usage: bash scripts/reproduce.sh [arm ...]     (default arms: baseline fp32_rollout r3)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
PY=.venv/bin/python
EXP=experiments/00_tiny_moe_cpu
OUT=results/reproduce
ARMS=("$@")
[ ${#ARMS[@]} -gt 0 ] || ARMS=(baseline fp32_rollout r3)
# An arm's former name (moerl.config.RENAMED_ARMS, e.g. mis) is run, skipped and compared under its current one.
current=$($PY -c 'import sys; from moerl.config import current_arm
print("\n".join(current_arm("00_tiny_moe_cpu", a) for a in sys.argv[1:]))' "${ARMS[@]}")
mapfile -t ARMS <<< "$current"

$PY scripts/warm_start.py $EXP/base.yaml
for arm in "${ARMS[@]}"; do
  cfg=$EXP/arms/$arm.yaml
  [ -f "$cfg" ] || { echo "no such arm: $cfg" >&2; exit 2; }
  run=$OUT/00_tiny_moe_cpu/$arm/seed0
  if [ -f "$run/summary.json" ]; then
    echo "[reproduce] $arm: already finished ($run/summary.json), skipping"
  elif [ -d "$run/checkpoints" ]; then
    echo "[reproduce] $arm: resuming"
    $PY scripts/run.py "$cfg" --resume tracking.output_dir=$OUT
  else
    $PY scripts/run.py "$cfg" --fresh tracking.output_dir=$OUT
  fi
done
$PY scripts/make_figures.py --runs $OUT --out $OUT/figures
$PY scripts/compare_runs.py $OUT/00_tiny_moe_cpu "${ARMS[@]}" --out $OUT/figures/compare_runs.png
status=0
failed=()
for arm in "${ARMS[@]}"; do
  echo "[reproduce] $arm against the recorded run:"
  rc=0
  $PY scripts/check_reproducible.py --arm "$arm" --steps 0 --run "$OUT/00_tiny_moe_cpu/$arm/seed0" || rc=$?
  if [ $rc -ne 0 ]; then failed+=("$arm"); [ $status -eq 1 ] || status=$rc; fi
done
if [ $status -ne 0 ]; then
  echo "[reproduce] NOT reproduced: ${failed[*]} (see above); finished in $(( $(date +%s) - start )) s" >&2
else
  echo "[reproduce] reproduced: ${ARMS[*]}; finished in $(( $(date +%s) - start )) s"
fi
exit $status
