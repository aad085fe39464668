#!/usr/bin/env bash
# Compose against verl's config, validate every constraint, print the command, run verl.trainer.main_ppo.
#   ./launch.sh [--arm X] [--seed N] [--dry-run] [hydra.key=value ...]
# Single node: run as is. Multi-node: start Ray on every node first and export RAY_ADDRESS
# (scripts/slurm_verl.sbatch does both, after checking every node with scripts/check_cluster_env.py).
# The Python it uses: $PYTHON, else python3, else this checkout's .venv (scripts/cluster_launch.sh).
exec bash "$(dirname "$0")/../../scripts/cluster_launch.sh" "$(basename "$(cd "$(dirname "$0")" && pwd)")" "$@"
