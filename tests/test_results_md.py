"""results/RESULTS.md is what its generators write from the recorded runs: a regeneration of the 00 and 05
sections (scripts/write_results.py) leaves the committed file byte for byte, so a number, verdict or
post-hoc label there cannot go stale. (06's and 07's sections are rewritten by scripts/geometry_figures.py
and experiments/07_dose_threshold/report.py, each kept between its own markers.)"""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_results_md_regenerates_unchanged_from_the_recorded_runs(tmp_path):
    committed = (REPO / "results" / "RESULTS.md").read_text()
    out = tmp_path / "RESULTS.md"
    out.write_text(committed)
    proc = subprocess.run([sys.executable, "scripts/write_results.py", "results/runs/00_tiny_moe_cpu",
                           "results/runs/05_mismatch_consequences", "--out", str(out), "--figures", "figures"],
                          cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    regenerated = out.read_text()
    if regenerated != committed:
        old, new = committed.splitlines(), regenerated.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        raise AssertionError(f"results/RESULTS.md differs from its regeneration from line {first + 1}:\n"
                             f"  committed:   {old[first][:300] if first < len(old) else '<end>'}\n"
                             f"  regenerated: {new[first][:300] if first < len(new) else '<end>'}\n"
                             "run scripts/write_verdicts.sh and commit results/")
