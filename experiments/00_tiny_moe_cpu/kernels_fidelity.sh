#!/usr/bin/env bash
# Fidelity of the emulated rollout kernels: experiment 00's baseline and r3, 3 seeds, 1 thread per run,
#   1. emulated kernels                      -> results/kernels/runs/emulated/
#   2. native kernels under ONEDNN_MAX_CPU_ISA=AVX2 (what an AVX2-only CPU runs) -> results/kernels/runs/native_avx2/
#   3. emulated kernels under ONEDNN_MAX_CPU_ISA=AVX2 (must reproduce 1)          -> results/kernels/runs/emulated_avx2/
# The native runs at the default ISA are experiment 00's earlier (native-kernel) recording of these arms, kept in
# results/kernels/runs/native/ (the recorded ablation in results/runs/ is now emulated). Resumable:
# finished runs are skipped. Then: python scripts/kernel_fidelity.py (the table, and the logprob-level check).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
sweep() { "$PY" scripts/sweep.py experiments/00_tiny_moe_cpu --seeds 3 --arms baseline,r3 --jobs "${JOBS:-1}" --threads 1 "$@"; }
sweep --output-dir results/kernels/runs/emulated rollout.kernels=emulated
ONEDNN_MAX_CPU_ISA=AVX2 sweep --output-dir results/kernels/runs/native_avx2 rollout.kernels=native
ONEDNN_MAX_CPU_ISA=AVX2 sweep --output-dir results/kernels/runs/emulated_avx2 rollout.kernels=emulated
