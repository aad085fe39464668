#!/usr/bin/env bash
# Everything the recorded figures need from a CPU of another kind than the one they were recorded on
# (they were recorded on an Intel Xeon with AVX512-BF16 + AMX; the other kind is e.g. an AMD EPYC with
# AVX2 only), in one command:
#
#   bash scripts/check_other_cpu.sh [--only reproduce|speed]
#
# 1. reproduce: experiment 00's recorded runs re-run for 10 steps and checked by
#    scripts/check_reproducible.py, which applies the bitwise check on the CPU kind that recorded them and
#    the statistical one (the recorded seeds' spread) on another kind, and says which it applied:
#      - fp32_rollout: fp32 kernels; must reproduce;
#      - baseline (emulated bf16 kernels, the default): must reproduce -- the emulated kernels round at the
#        same points to the same formats on every CPU, hence the same statistics (bit for bit only where the
#        fp32 GEMMs whose products they round agree, i.e. on the recording's CPU kind);
#      - baseline with the native bf16 kernels (recorded in results/kernels/runs/native), bitwise: expected to
#        differ from step 1 on a CPU without AVX512-BF16/AMX, which is why the emulated path exists;
#    and experiment 07's uncorrected NVFP4 run (4-bit weights through the emulated kernels): must
#    reproduce as the emulated baseline does.
# 2. speed: bench_kernels.py (native vs emulated rollout and GRPO step, 1 thread) and bench_peer.py
#    (moerl / TRL GRPOTrainer, 1 thread; builds .venv-peer first if absent).
#
# Writes results/cpu/<cpu model>/ (one folder per CPU model, so results of several kinds sit side by side):
# one log per check and summary.md (check | expected | check applied | exit status).
# A check that fails does not stop the others; the script exits 1 if any check whose expectation is
# "reproduces" did not.
set -uo pipefail
cd "$(dirname "$0")/.."

only=all
if [ "${1:-}" = "--only" ]; then only=${2:?--only needs reproduce or speed}; fi
case $only in all|reproduce|speed) ;; *) echo "check_other_cpu: --only takes reproduce or speed, not '$only'" >&2; exit 2;; esac

model=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)
slug=$(echo "${model:-unknown}" | tr -cs 'A-Za-z0-9' '_' | sed 's/_$//')
flags=$(grep -o -w 'avx2\|avx512f\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')
out=results/cpu/$slug
mkdir -p "$out"
summary=$out/summary.md
{
  echo "# $model"
  echo
  echo "ISA flags: $flags"
  echo
  echo "The recorded runs were made on: $(.venv/bin/python -c 'import json, sys
m = json.load(open(sys.argv[1]))
print(m["cpu_model"] + ", ISA flags: " + " ".join(f for f, on in m["isa_flags"].items() if on))' \
    results/runs/00_tiny_moe_cpu/baseline/seed0/machine.json 2>/dev/null || echo unknown)."
  echo "Each check says which comparison applied: bitwise on the recording's CPU kind, statistical on another."
  echo
  echo "| check | expected | check applied | exit status here | log |"
  echo "|---|---|---|---|---|"
} > "$summary"

failed=0
run_check() {  # name, expectation (reproduces | differs | measured), command...
  local name=$1 expect=$2; shift 2
  echo "== $name ($expect): $*"
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -3 "$out/$name.log"
  local applied
  applied=$(sed -n 's/^check applied: \([a-z]*\).*/\1/p' "$out/$name.log" | head -1)
  echo "| $name | $expect | ${applied:--} | $rc | $name.log |" >> "$summary"
  if [ "$expect" != differs ] && [ $rc -ne 0 ]; then failed=1; fi
}

PY=.venv/bin/python
if [ "$only" != speed ]; then
  run_check fp32_rollout reproduces $PY scripts/check_reproducible.py --arm fp32_rollout --bitwise
  run_check baseline_emulated reproduces $PY scripts/check_reproducible.py --arm baseline --bitwise
  run_check baseline_native differs $PY scripts/check_reproducible.py --arm baseline \
    --recorded results/kernels/runs/native --check bitwise --bitwise
  run_check dose07_nvfp4 reproduces $PY scripts/check_reproducible.py --experiment experiments/07_dose_threshold \
    --arm baseline+rollout.dtype=nvfp4 --bitwise
fi
if [ "$only" != reproduce ]; then
  run_check bench_kernels measured $PY benchmarks/bench_kernels.py --isa default --out "$out/kernels"
  [ -x .venv-peer/bin/python ] || bash scripts/setup_peer_env.sh > "$out/setup_peer_env.log" 2>&1
  run_check bench_peer measured .venv-peer/bin/python benchmarks/bench_peer.py --threads 1 --out "$out/peer"
fi
echo "wrote $summary"
cat "$summary"
exit $failed
