# Sourced by the CPU experiments' launchers (experiments/0{0,5,6,7}_*/): one way to pick the Python,
# where runs go, and the smoke mode.
#   --record    write into results/ (the recorded runs a README and RESULTS.md are built from)
#   --out DIR   write into DIR (default: runs/, which git ignores)
#   --smoke     a tiny configuration of one arm, two steps, under two minutes: into <out>/smoke
# The remaining arguments are left in ARGS, in order: an arm, run/sweep options, key=value overrides.
# Python: $PYTHON when set (a cluster's or CI's environment), else .venv/bin/python (created on demand).
set -euo pipefail
# --help: the launcher's own usage (its header comment), before anything is set up.
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
  esac
done
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else
  bash scripts/setup_env.sh
  PY=.venv/bin/python
fi
# A dependency the interpreter lacks ends in one line naming it, before any run starts.
missing=$("$PY" -c 'import importlib.util
print(" ".join(m for m in ("torch", "transformers", "peft", "yaml", "omegaconf", "pandas", "matplotlib")
               if importlib.util.find_spec(m) is None))' 2>/dev/null) || missing="(it does not start)"
if [ -n "$missing" ]; then
  echo "error: $PY lacks $missing; run bash scripts/setup_env.sh (or set PYTHON to an interpreter with requirements/cpu.txt)" >&2
  exit 1
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
OUT="" RECORD=0 SMOKE=0 ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --record) RECORD=1 ;;
    --smoke) SMOKE=1 ;;
    --out) [ $# -ge 2 ] || { echo "error: --out needs a directory" >&2; exit 2; }; OUT=$2; shift ;;
    --out=*) OUT=${1#--out=} ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
if [ "$RECORD" = 1 ] && { [ "$SMOKE" = 1 ] || [ -n "$OUT" ]; }; then
  echo "error: --record writes into results/; it does not combine with --smoke or --out" >&2
  exit 2
fi
# The runs root: the recorded runs with --record, else runs/ (or --out), a smoke run below it.
if [ "$RECORD" = 1 ]; then RUNS=results/runs; else RUNS=${OUT:-runs}; fi
[ "$SMOKE" = 1 ] && RUNS=$RUNS/smoke
# Two GRPO steps of 4 prompts x 2 samples with a short held-out check, on the experiment's own model,
# task and committed warm start (no key that names the warm start is changed).
SMOKE_OVERRIDES=(trainer.steps=2 rollout.prompts_per_step=4 rollout.group_size=2 trainer.mini_batches=2
                 trainer.micro_batch_size=8 trainer.warmup_steps=0 trainer.eval_every=2 trainer.eval_size=8
                 trainer.eval_samples=1 trainer.checkpoint_every=2 trainer.samples_every=2
                 trainer.paired_replay_every=0 tracking.wandb_mode=disabled)
# ARM and the rest: the first argument is an arm when it is neither an option nor an override.
ARM="" REST=()
if [ ${#ARGS[@]} -gt 0 ] && [[ "${ARGS[0]}" != -* && "${ARGS[0]}" != *=* ]]; then
  ARM=${ARGS[0]}
  REST=("${ARGS[@]:1}")
else
  REST=("${ARGS[@]+"${ARGS[@]}"}")
fi
