"""experiments/05_mismatch_consequences/pilot_table.py: the pilot table from archived pilot directories."""
from __future__ import annotations

import subprocess
import sys

from tests_helpers import REPO

SCRIPT = REPO / "experiments" / "05_mismatch_consequences" / "pilot_table.py"
PILOTS = sorted((REPO / "results" / "pilots").glob("05_p1_*"))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_an_archived_pilot_gives_one_markdown_row():
    assert PILOTS, "results/pilots/05_p1_* is the archived pilot this test reads"
    proc = _run("--markdown", str(PILOTS[0]))
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.splitlines()
    assert len(rows) == 1 and rows[0].startswith(f"| {PILOTS[0].name} | ")


def test_a_directory_without_pilot_runs_is_one_line_naming_it(tmp_path):
    """A mistyped or unmatched directory (a shell glob that matched nothing) used to print nothing and
    exit 0; now nothing is printed and the one error line names it."""
    missing = tmp_path / "pilots" / "*"
    proc = _run("--markdown", str(PILOTS[0]), str(missing))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().startswith(f"pilot_table: {missing}: no metrics.jsonl or metrics.jsonl.gz under it")


def test_help_shows_the_usage():
    proc = _run("--help")
    assert proc.returncode == 0 and "pilot_table.py --markdown results/pilots/05_*" in proc.stdout
