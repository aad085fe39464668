"""Summarise pilot runs (one row per run directory) for the pilot table in README.md.

    python experiments/05_mismatch_consequences/pilot_table.py [--markdown] runs/pilots/<name> [...]
    python experiments/05_mismatch_consequences/pilot_table.py --markdown results/pilots/05_*   # recorded

Per run (moerl.analysis.pilots.summarise): steps, training reward as 25-step means, mean k3, tokens
re-routed in any layer, grad-norm median/max, non-finite updates, the collapse step (moerl.analysis.collapse)
and the initial/final pass@1. The README's table is written from results/pilots/05_* by
scripts/write_readme_numbers.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moerl.analysis.pilots import markdown_row, pilot_config, summarise


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", action="store_true", help="a table row per run (default: a JSON object per run)")
    ap.add_argument("pilots", nargs="+", help="pilot directories, e.g. runs/pilots/<name> or results/pilots/05_*")
    args = ap.parse_args(argv)
    # every directory is checked before a row is printed: a mistyped one is named, not skipped in silence
    found = {arg: sorted(Path(arg).rglob("metrics.jsonl*")) for arg in args.pilots}
    for arg, metrics in found.items():
        if not metrics:
            sys.exit(f"pilot_table: {arg}: no metrics.jsonl or metrics.jsonl.gz under it (expected a pilot "
                     "directory written by pilots.sh, or an archived one in results/pilots/)")
    for arg, metrics in found.items():
        for path in metrics:
            s = summarise(path.parent, Path(arg).name)
            print(markdown_row(s, pilot_config(path.parent)) if args.markdown else json.dumps(s))


if __name__ == "__main__":
    main()
