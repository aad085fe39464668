"""Execute the analysis notebooks headless and save them with their outputs (figures inline).

    python scripts/run_notebooks.py [--out results/notebooks] [--results results/runs]
                                    [--experiment 00_tiny_moe_cpu] [--arms baseline,r3] [NOTEBOOK ...]

Runs each notebook (default: every analysis/*.ipynb) top to bottom with nbclient in this
interpreter's kernel (the repo's venv), from the notebook's own directory (analysis/, as nbconvert
runs it), with $MOERL_RESULTS / $MOERL_EXPERIMENT / $MOERL_ARMS set from the options, and writes the executed copy to --out; the notebooks in analysis/ stay
output-free. Equivalent by hand, from the venv (requirements/cpu.txt installs nbconvert):
`.venv/bin/jupyter nbconvert --to notebook --execute analysis/NAME.ipynb` with the same environment variables.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

REPO = Path(__file__).resolve().parents[1]


def kernel_spec(root: Path) -> str:
    """A private kernelspec for this interpreter, so the notebooks run in the repo's venv whatever
    other kernels the machine has."""
    spec = root / "kernels" / "moerl-venv"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "moerl venv", "language": "python"}))
    os.environ["JUPYTER_PATH"] = str(root)
    return "moerl-venv"


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", help="default: analysis/*.ipynb")
    ap.add_argument("--out", default="results/notebooks")
    ap.add_argument("--results", help="runs root ($MOERL_RESULTS; default results/runs)")
    ap.add_argument("--experiment", help="$MOERL_EXPERIMENT (default 00_tiny_moe_cpu)")
    ap.add_argument("--arms", help="comma-separated arms ($MOERL_ARMS; default all)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = ap.parse_args(argv)
    for var, value in (("MOERL_RESULTS", args.results), ("MOERL_EXPERIMENT", args.experiment), ("MOERL_ARMS", args.arms)):
        if value:
            os.environ[var] = str(Path(value).resolve()) if var == "MOERL_RESULTS" else value
    paths = [Path(p) for p in args.notebooks] or sorted((REPO / "analysis").glob("*.ipynb"))
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        sys.exit(f"run_notebooks: no such notebook: {', '.join(missing)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        kernel = kernel_spec(Path(tmp))
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            print(f"running {path.name} ...", flush=True)
            try:
                NotebookClient(nb, timeout=args.timeout, kernel_name=kernel,
                               resources={"metadata": {"path": str(path.resolve().parent)}}).execute()
            except CellExecutionError as err:
                sys.exit(f"run_notebooks: {path.name} failed: {str(err).strip().splitlines()[-1]}")
            target = out_dir / path.name
            nbformat.write(nb, target)
            written.append(target)
            print(f"wrote {target}")
    return written


if __name__ == "__main__":
    main()
