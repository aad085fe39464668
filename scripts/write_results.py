"""Write results/RESULTS.md: per experiment, one row per arm, mean ± std over seeds.

    python scripts/write_results.py results/runs/00_tiny_moe_cpu [more experiment dirs ...]
                                    [--out results/RESULTS.md] [--figures figures]

Each experiment directory becomes one section, in the order given.

For experiment 05 the section opens with its claims table (moerl.analysis.claims): the source's value,
this repository's value and whether it was reproduced. Each table column is defined under the
table (``COLUMNS``): held-out accuracy with its step-0 value, k3 KL between rollout and trainer
(run median, its ratio to the same family's baseline, run mean), routing agreement averaged over
layers and over all layers at once, PPO clip / mask / truncation fractions, token- and
sequence-level IS ratio p99, wall time per run. The header names the commit(s) that produced the runs (their git_sha.txt), the machine(s)
they ran on (machine.json: bf16 numerics depend on the CPU's bf16 instructions, fp32 runs do not),
the total sweep wall time measured by scripts/sweep.py (sweep.json), and links the experiment's
figures (one per question of experiments/<name>/figures.yaml). The tables are built in
moerl.analysis.results_tables.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from moerl.analysis.results import MissingRunError, load_sweep, run_table
from moerl.analysis.results_tables import render
from moerl.tracking import atomic_write_text


# A section another script writes into the same file, between its own markers (experiment 06's, by
# scripts/geometry_figures.py): kept as it is when this script rewrites the rest.
MARKED_SECTION = re.compile(r"<!-- (?P<name>[^:>]+): begin \([^)]*\) -->.*?<!-- (?P=name): end -->", re.S)


def kept_sections(text: str) -> list[str]:
    return [m.group(0) for m in MARKED_SECTION.finditer(text)]


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment_dirs", nargs="+", help="e.g. results/runs/00_tiny_moe_cpu")
    ap.add_argument("--out", default="results/RESULTS.md")
    ap.add_argument("--figures", default="figures",
                    help="figure directory as linked from --out (relative to it); '' for no images")
    args = ap.parse_args(argv)
    sections = []
    for exp_dir in map(Path, args.experiment_dirs):
        try:
            runs = run_table(exp_dir.parent, exp_dir.name)
        except MissingRunError as err:
            sys.exit(f"write_results: {err}")
        sections.append(render(exp_dir, runs, load_sweep(exp_dir), args.figures or None))
    command = "python scripts/write_results.py " + " ".join(args.experiment_dirs)
    # No date of writing: the file is tracked, and unchanged runs must regenerate it byte for byte.
    text = "\n".join(["# Results", "", f"Written by `{command}`.", ""] + sections)
    out = Path(args.out)
    kept = kept_sections(out.read_text()) if out.exists() else []
    text = "\n".join([text.rstrip("\n"), *kept]) + "\n" if kept else text
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    print(f"wrote {out} ({len(sections)} experiment section(s) rewritten, {len(kept)} generated section(s) kept)")
    return out


if __name__ == "__main__":
    main()
