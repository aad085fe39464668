"""Where a benchmark writes: under runs/bench/ (git-ignored) unless ``--record``, as the experiments do.

The recorded files under ``results/`` are what docs/benchmarks.md and the READMEs' generated tables read;
a quick look at a benchmark must not replace them, so only ``--record`` writes there.
"""
from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def add_output_args(ap: argparse.ArgumentParser, recorded: str) -> None:
    """``--out DIR`` and ``--record`` (into ``recorded``, a folder of the repository's results/)."""
    scratch = scratch_dir(recorded)
    ap.add_argument("--out", default=None,
                    help=f"where the files go (default {scratch.relative_to(REPO)}/, git-ignored)")
    ap.add_argument("--record", action="store_true",
                    help=f"write the recorded files in {recorded}/ (what the docs' tables read) instead")
    ap.set_defaults(_recorded=recorded)


def scratch_dir(recorded: str) -> Path:
    """runs/bench/<what> for results/<...>/<what>: results/bench/experts -> runs/bench/experts."""
    return REPO / "runs" / "bench" / Path(recorded).name


def output_dir(args: argparse.Namespace) -> Path:
    """The folder a benchmark run writes into; ``--record`` with ``--out`` is refused in one line."""
    if args.record and args.out:
        raise SystemExit("error: --record writes into the recorded folder; it does not combine with --out")
    if args.record:
        return REPO / args._recorded
    return Path(args.out) if args.out else scratch_dir(args._recorded)
