#!/usr/bin/env bash
# Experiment 08: LoRA GRPO on a real MoE checkpoint on one GPU. Usage:
#   experiments/08_real_moe/launch.sh r3 model.path=DIR data.train_path=F data.test_path=F [--seed 1] [key=value ...]
#   experiments/08_real_moe/launch.sh --dry-run [ARM] [--qwen3] [key=value ...]   # the memory plan, nothing loaded
#   experiments/08_real_moe/launch.sh --smoke [ARM]   # two steps on a tiny OLMoE-shaped checkpoint written here (CPU)
#   experiments/08_real_moe/launch.sh --help
# --qwen3: the second preset, Qwen3-30B-A3B (bf16 trainer, LoRA rank 8) on one 141 GB GPU.
# Runs go to runs/08_real_moe/ (gitignored); --out DIR elsewhere.
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
DRY=0 QWEN3=0 PASS=()
for a in "$@"; do
  case "$a" in --dry-run) DRY=1 ;; --qwen3) QWEN3=1 ;; *) PASS+=("$a") ;; esac
done
set -- "${PASS[@]+"${PASS[@]}"}"
source scripts/launch_common.sh
exp=experiments/08_real_moe
QWEN3_OVERRIDES=(model.path=checkpoints/Qwen3-30B-A3B-Instruct-2507 trainer.dtype=bf16 lora.rank=8 lora.alpha=16
                 trainer.micro_batch_size=4 rollout.prompts_per_step=8)
[ "$QWEN3" = 1 ] && REST=("${QWEN3_OVERRIDES[@]}" "${REST[@]+"${REST[@]}"}")
if [ "$DRY" = 1 ]; then
  config=$exp/model_configs/olmoe_1b_7b_0125_instruct.json gib=80
  [ "$QWEN3" = 1 ] && config=$exp/model_configs/qwen3_30b_a3b.json gib=141
  exec "$PY" scripts/plan_device.py "$exp/arms/${ARM:-baseline}.yaml" --model-config "$config" --device-gib "$gib" \
    "${REST[@]+"${REST[@]}"}"
fi
if [ "$SMOKE" = 1 ]; then
  double=$RUNS/08_double
  "$PY" scripts/write_checkpoint_double.py olmoe "$double/olmoe" --data "$double/gsm8k"
  exec "$PY" scripts/run.py "$exp/arms/${ARM:-r3}.yaml" --fresh --no-progress "tracking.output_dir=$RUNS" \
    "model.path=$double/olmoe" "data.train_path=$double/gsm8k/train.jsonl" "data.test_path=$double/gsm8k/test.parquet" \
    device=cpu rollout.kernels=emulated rollout.max_new_tokens=16 data.max_prompt_tokens=256 lora.rank=4 lora.alpha=8 \
    trainer.activation_checkpointing=false "${SMOKE_OVERRIDES[@]}" "${REST[@]+"${REST[@]}"}"
fi
[ -n "$ARM" ] || { echo "error: name an arm (ls $exp/arms), or --dry-run / --smoke" >&2; exit 2; }
exec "$PY" scripts/run.py "$exp/arms/$ARM.yaml" "tracking.output_dir=$RUNS" "${REST[@]+"${REST[@]}"}"
