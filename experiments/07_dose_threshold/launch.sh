#!/usr/bin/env bash
# Experiment 07, resumable (finished runs are skipped, interrupted ones resumed).
#   launch.sh pilot [key=value ...]              the ladder: the uncorrected arm at every rung + the fp32 control, seed 0
#   launch.sh main RUNG [BELOW] [key=value ...]  every mitigation arm, 3 seeds, at the threshold rung and the rung below
#   launch.sh control [key=value ...]            the fp32 control on 3 seeds (the regime's "control learns" check)
#   launch.sh confirm [key=value ...]            the confirmatory grids registered in analysis.yaml (control, fp8,
#                                                nvfp4 for 600 steps)
#   launch.sh mechanism [key=value ...]          experts-only / attention-only / Kimi INT4 rungs, fake-INT4 trainer arms
#   launch.sh crossover [key=value ...]          dose against location: int3 (narrow) experts / int6 attention beside the
#                                                int4 halves and a 600-step fp32 control (keeping its checkpoints),
#                                                each control seed followed by its drift null (drift_null.py);
#                                                one run at a time, seed by seed
#   (confirm, mechanism and crossover run every run on the one path analysis.yaml's rollout_path names, and refuse while
#    it is unset; their sweeps run --blind: progress and closing tables without reward, k3 or pass@1)
#   launch.sh ARM [--seed N] [key=value ...]     one run, e.g. launch.sh tis rollout.dtype=nvfp4
#   launch.sh --smoke [ARM] [key=value ...]      two tiny steps (default: baseline at nvfp4), under 2 minutes
# Runs go to runs/07_dose_threshold/ (gitignored); --record writes the recorded grid in results/runs
# (commit results/ as runs land), --out DIR elsewhere. One thread per run, JOBS runs at a time (default 2).
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
source scripts/launch_common.sh
export OMP_NUM_THREADS=1
JOBS=${JOBS:-2}
exp=experiments/07_dose_threshold
# key=value overrides and --options (sweep's: --dry-run, --seeds ...) go to every sweep; other words are rungs.
overrides=() words=()
for a in "${REST[@]+"${REST[@]}"}"; do
  if [[ "$a" == *=* || "$a" == -* ]]; then overrides+=("$a"); else words+=("$a"); fi
done
sweep() { "$PY" scripts/sweep.py "$exp" --jobs "${JOBS}" --threads 1 --output-dir "$RUNS" "$@" \
            "${overrides[@]+"${overrides[@]}"}"; }
if [ "$SMOKE" = 1 ]; then
  [ -n "$ARM" ] || overrides=(rollout.dtype=nvfp4 "${overrides[@]+"${overrides[@]}"}")
  exec "$PY" scripts/run.py "$exp/arms/${ARM:-baseline}.yaml" --fresh --no-progress "tracking.output_dir=$RUNS" \
    "${SMOKE_OVERRIDES[@]}" "${words[@]+"${words[@]}"}" "${overrides[@]+"${overrides[@]}"}"
fi
case "$ARM" in
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
    [[ ${#words[@]} -ge 1 ]] || { echo "usage: launch.sh main RUNG [BELOW] [key=value ...]" >&2; exit 2; }
    sweep --arms fp32_control --seeds 3
    for rung in "${words[@]}"; do
      sweep --arms baseline,r3,tis,r3_tis,icepop,geo_mis_0p1pct --seeds 3 "rollout.dtype=$rung"  # the claims' arms first
    done ;;
  confirm|mechanism|crossover)
    # the rollout path every run of these grids is recorded on, from the registered analysis (one line out)
    path=$("$PY" -c "import yaml; p = yaml.safe_load(open('experiments/07_dose_threshold/analysis.yaml'))['rollout_path']; print(p['key'] + '=' + str(p['value']))")
    case "$path" in
      *pending*) echo "launch.sh $ARM: experiments/07_dose_threshold/analysis.yaml rollout_path is not set ($path); commit the fast path's fidelity check and name it there first" >&2; exit 2 ;;
    esac
    eval8="trainer.eval_samples=8"  # 2,048 completions per evaluation (analysis.yaml eval_completions)
    # their verdicts are sealed until a grid's last run lands: the sweeps print steps and times, no outcome
    overrides=(--blind "${overrides[@]+"${overrides[@]}"}")
    # Seed by seed, so that wherever a grid stops every arm (and every mechanism rung) has the same seeds
    # and the paired comparisons can be read; an interrupted run resumes before anything new starts.
    if [[ $ARM == crossover ]]; then
      # One run at a time; seed by seed, so wherever the grid stops every cell has the same seeds. Within a
      # seed the new dose-matched cells first (the crossover's question), then the control (its checkpoints
      # feed the drift null, measured at once), then the int4 halves the mechanism grid already ran at 300 steps.
      JOBS=1
      seeds=$("$PY" -c "import yaml; g = yaml.safe_load(open('$exp/analysis.yaml'))['grids']['crossover']; print(' '.join(map(str, g['seeds'])))")
      steps="trainer.steps=600"
      for seed in $seeds; do
        for rung in int3n_experts int6_attention; do
          sweep --arms baseline --seed-list "$seed" "rollout.dtype=$rung" "$steps" "$path" "$eval8"
        done
        sweep --arms fp32_control --seed-list "$seed" "$steps" trainer.keep_checkpoints=0 "$path" "$eval8"
        control=$RUNS/$(basename "$exp")/fp32_control+trainer.steps-600+trainer.eval_samples-8/seed$seed
        null=("$PY" "$exp/drift_null.py" "$control" --out results/07_dose_threshold/drift_null)
        if [[ " ${overrides[*]} " == *" --dry-run "* ]]; then echo "drift null: \$ ${null[*]}"; else "${null[@]}"; fi
        for rung in int4_experts int4_attention; do
          sweep --arms baseline --seed-list "$seed" "rollout.dtype=$rung" "$steps" "$path" "$eval8"
        done
      done
    elif [[ $ARM == confirm ]]; then
      sweep --arms fp32_control --seeds 12 "$path" "$eval8"
      sweep --arms baseline,r3,tis,icepop,r3_tis --seeds 12 --order seed rollout.dtype=fp8 "$path" "$eval8"
      sweep --arms baseline,tis,icepop,r3_tis --seeds 5 --order seed rollout.dtype=nvfp4 trainer.steps=600 "$path" "$eval8"
    else
      for seed in 0 1 2 3 4; do
        for rung in nvfp4_experts nvfp4_attention int4_experts int4_attention int4_kimi; do
          sweep --arms baseline,r3 --seed-list "$seed" "rollout.dtype=$rung" "$path" "$eval8"
        done
        sweep --arms qat_int4,qat_int4_r3,qat_int4_tis --seed-list "$seed" "$path" "$eval8"
      done
    fi ;;
  "") echo "usage: launch.sh [--record | --out DIR] pilot | control | main RUNG [BELOW] | confirm | mechanism | crossover | ARM [--seed N] | --smoke [ARM]" \
        "[key=value ...]" >&2; exit 2 ;;
  *)
    # run.py names the arms there when ARM is none of them; an arm's former name loads its current file.
    exec "$PY" scripts/run.py "$exp/arms/$ARM.yaml" "tracking.output_dir=$RUNS" "${REST[@]+"${REST[@]}"}" ;;
esac
