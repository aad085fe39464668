#!/usr/bin/env bash
# The cluster experiments' launcher (experiments/0{1,2,3,4}_*/launch.sh call it with their folder name):
# compose against verl's config, validate every constraint, print the command, run verl.trainer.main_ppo.
#   bash scripts/cluster_launch.sh <experiment folder name> [--arm X] [--seed N] [--dry-run] [hydra.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] && [ -d "experiments/$1" ] || { echo "error: expected an experiment folder name under experiments/, got '${1:-}'" >&2; exit 2; }
EXPERIMENT=$1
shift
# --help: the launcher's own usage (its header), not the Python module's.
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "experiments/$EXPERIMENT/launch.sh"; exit 0 ;;
  esac
done
export MOERL_REPO="${MOERL_REPO:-$PWD}"
# The cluster environment's Python ($PYTHON, e.g. a container's or a venv's), never a bare `python`.
# Unset: python3 (a cluster image's), or, where python3 has no moerl or no torch, this checkout's .venv (the CPU
# stack of scripts/setup_env.sh: enough for --dry-run on a workstation).
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && ! python3 -c "import moerl, torch" 2>/dev/null && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
    echo "launch.sh: python3 has no moerl or no torch; using $PY (set PYTHON to choose another)" >&2
fi
if ! "$PY" -c "import moerl" 2>/dev/null; then
    echo "error: moerl is not installed in this environment; Ray workers import it (reward, losses)." >&2
    echo "fix: $PY -m pip install --no-deps -e . (on every node, or in the shared environment)" >&2
    exit 1
fi
# A dependency the interpreter lacks ends in one line naming it, not a traceback (moerl.entry).
exec "$PY" -m moerl.entry moerl.verl_ext.launch "experiments/$EXPERIMENT" "$@"
