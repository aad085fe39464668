#!/usr/bin/env bash
# Fit this checkout under 64 MiB while it is copied to a GPU machine whose transfer has that limit.
#
#     bash scripts/device_checkout.sh size      # MiB that would travel now (tracked + untracked-not-ignored)
#     bash scripts/device_checkout.sh slim      # stop tracking the recorded results, in the index only
#     bash scripts/device_checkout.sh restore   # track them again: the index as it was, nothing else changed
#
# Such a copy takes every tracked file and every untracked file git does not ignore. The recorded results (results/runs/, results/warm_start/: about 160 MiB) are outputs of
# earlier runs, not inputs of any prepared GPU check (scripts/gpu_router_replay.sh, gpu_width_geometry.py).
# `slim` removes them from the index (`git rm --cached`: the files stay on disk) and ignores them in
# .git/info/exclude, so they no longer travel; `restore` puts the index entries back from HEAD and drops
# the exclude lines. Nothing is committed, and a pre-commit hook refuses any commit in between (a commit
# made while slim would record the deletion of every result). Refused when the index already holds staged
# changes, since `restore` resets these paths' index entries to HEAD.
set -euo pipefail
cd "$(dirname "$0")/.."
PATHS=(results/runs results/warm_start)
LIMIT_MIB=64
marker=$(git rev-parse --git-path moerl-device-slim)
exclude=$(git rev-parse --git-path info/exclude)
hook=$(git rev-parse --git-path hooks/pre-commit)
BEGIN="# moerl device-slim begin (scripts/device_checkout.sh restore removes these lines)"
END="# moerl device-slim end"

size_mib() {
  git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null |
    awk -v limit="$LIMIT_MIB" '{s += $1} END {printf "%.1f MiB would travel (device limit %d MiB; carried paths such as .whl/ count too)\n", s / 1048576, limit}'
}

case "${1:-}" in
  size)
    size_mib
    ;;
  slim)
    if [ -e "$marker" ]; then
      echo "[device-checkout] already slim ($marker): run 'bash scripts/device_checkout.sh restore' first" >&2; exit 1
    fi
    if ! git diff --cached --quiet; then
      echo "[device-checkout] the index holds staged changes: commit or unstage them first (restore resets ${PATHS[*]} in the index to HEAD)" >&2
      exit 1
    fi
    if [ -e "$hook" ]; then
      echo "[device-checkout] $hook exists: slim installs a temporary pre-commit hook and will not replace yours" >&2
      exit 1
    fi
    git rm -r -q --cached -- "${PATHS[@]}"
    { echo "$BEGIN"; for p in "${PATHS[@]}"; do echo "/$p/"; done; echo "$END"; } >> "$exclude"
    mkdir -p "$(dirname "$hook")"
    printf '%s\n' '#!/bin/sh' \
      'echo "moerl: this checkout is slimmed for a copy to a GPU machine (the recorded results are out of the index);" >&2' \
      'echo "       run bash scripts/device_checkout.sh restore before committing" >&2' 'exit 1' > "$hook"
    chmod +x "$hook"
    printf '%s\n' "${PATHS[@]}" > "$marker"
    echo "[device-checkout] slim: ${PATHS[*]} out of the index (files kept on disk); commits refused until restore"
    size_mib
    ;;
  restore)
    if [ ! -e "$marker" ]; then
      echo "[device-checkout] not slim (no $marker): nothing to restore" >&2; exit 1
    fi
    mapfile -t slimmed < "$marker"
    git reset -q -- "${slimmed[@]}"
    awk -v begin="$BEGIN" -v end="$END" '$0 == begin {skip = 1} !skip {print} $0 == end {skip = 0}' "$exclude" \
      > "$exclude.tmp" && mv "$exclude.tmp" "$exclude"
    rm -f "$hook" "$marker"
    echo "[device-checkout] restored: ${slimmed[*]} tracked again"
    size_mib
    ;;
  *)
    echo "usage: bash scripts/device_checkout.sh size|slim|restore" >&2; exit 2
    ;;
esac
