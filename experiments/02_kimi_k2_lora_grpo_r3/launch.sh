#!/usr/bin/env bash
# Compose against verl's config, validate, print the command, run verl.trainer.main_ppo.
# Single node: run as is. Multi-node: start Ray on every node first and export RAY_ADDRESS
# (scripts/slurm_verl.sbatch does both). Pass --dry-run to only compose, validate and print.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MOERL_REPO="${MOERL_REPO:-$PWD}"
exec python -m moerl.verl_ext.launch "experiments/$(basename "$(dirname "$0")")" "$@"
