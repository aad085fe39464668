#!/usr/bin/env bash
# The test suite, CPU only: sets up .venv if needed, then runs pytest. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/python -m pytest tests "$@"
