"""Every analysis notebook runs top to bottom (nbclient) on the committed fixture runs.

The kernel is this interpreter's ipykernel, registered under a private kernelspec in a temporary
JUPYTER_PATH, so the test uses the venv's python whatever other kernels the machine has."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "analysis").glob("*.ipynb"))
FIXTURE_RUNS = REPO / "tests" / "fixtures" / "runs"
FIXTURE_REFIT = REPO / "tests" / "fixtures" / "refit"
# Experiment 05's notebook reads its own fixture: three DeepSeek-V3 arms x 2 seeds of the recorded
# runs, with the keys it draws only; experiment 07's, the control and one rung of its recorded runs.
FIXTURE_RUNS_BY_NOTEBOOK = {"06_mismatch_consequences": REPO / "tests" / "fixtures" / "runs_05",
                            "08_dose_ladder": REPO / "tests" / "fixtures" / "runs_07"}


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "moerl-venv"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "moerl venv", "language": "python"}))
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", str(root))
    yield "moerl-venv"
    mp.undo()


def test_notebooks_exist_and_are_stripped():
    assert len(NOTEBOOKS) >= 5, NOTEBOOKS
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), f"{path}: no title"
        assert nb.cells[0].source.splitlines()[0].rstrip().endswith("?"), f"{path}: title is not a question"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path}: outputs not stripped"
        # nbformat 4.5 requires a cell id (nbformat.read only warns, and adds a random one on every read)
        raw = json.loads(path.read_text())
        missing = [i for i, cell in enumerate(raw["cells"]) if "id" not in cell]
        assert (raw["nbformat"], raw["nbformat_minor"]) < (4, 5) or not missing, f"{path}: cells {missing} have no id"


def _execute(path: Path, kernel_name: str) -> list:
    """Run the notebook as `jupyter nbconvert --execute` does: from its own directory, analysis/ (a
    relative path in it must not depend on being started from the repository root)."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name=kernel_name,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def _answer(nb) -> str:
    """The text of the notebook's last cell: a code cell stating the answer computed from the data."""
    last = nb.cells[-1]
    assert last.cell_type == "code", "the last cell must compute the answer, not describe an expectation"
    return json.dumps([o.get("data", {}).get("text/markdown", "") for o in last.outputs])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_from_analysis_and_ends_with_its_answer(path, kernel_name, monkeypatch):
    monkeypatch.setenv("MOERL_RESULTS", str(FIXTURE_RUNS_BY_NOTEBOOK.get(path.stem, FIXTURE_RUNS)))
    monkeypatch.setenv("MOERL_REFIT", str(FIXTURE_REFIT))
    monkeypatch.delenv("MOERL_GEOMETRY", raising=False)  # 07 finds results/geometry from analysis/
    monkeypatch.delenv("MOERL_EXPERIMENT", raising=False)
    monkeypatch.setenv("MOERL_SMOOTH", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = _execute(path, kernel_name)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # Each notebook displays a figure (inline PNG), and every cell that makes one with plt.subplots shows it: no
    # cell left the kernel off its inline backend (a report's figure function draws off-screen, on Agg).
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name}: no figure was displayed"
    drawing = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "plt.subplots(" in c.source]
    blank = [i for i in drawing if not any("image/png" in o.get("data", {}) for o in nb.cells[i].outputs)]
    assert not blank, f"{path.name}: cells {blank} draw a figure that is not displayed"
    assert "Answer, computed from these runs" in _answer(nb), f"{path.name}: no computed answer at the end"


def test_a_notebook_reads_another_experiments_runs(kernel_name, monkeypatch):
    """The per-arm notebooks are not tied to experiment 00: on experiment 07's runs (names with
    +overrides) 01 compares each arm with the baseline at the same rung."""
    monkeypatch.setenv("MOERL_RESULTS", str(FIXTURE_RUNS_BY_NOTEBOOK["08_dose_ladder"]))
    monkeypatch.setenv("MOERL_EXPERIMENT", "07_dose_threshold")
    monkeypatch.setenv("MOERL_SMOOTH", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = _execute(REPO / "analysis" / "01_kl_mismatch.ipynb", kernel_name)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert "Answer, computed from these runs" in _answer(nb)


def test_run_notebooks_script_saves_executed_copies(tmp_path):
    """The documented command executes a notebook with an arm selection and keeps its outputs."""
    import subprocess

    out = tmp_path / "executed"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "run_notebooks.py"), str(NOTEBOOKS[0]),
                           "--out", str(out), "--results", str(FIXTURE_RUNS), "--arms", "baseline,r3"],
                          capture_output=True, text=True, cwd=REPO, env={**__import__("os").environ,
                                                                        "OMP_NUM_THREADS": "1", "MOERL_SMOOTH": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    nb = nbformat.read(out / NOTEBOOKS[0].name, as_version=4)
    text = json.dumps([o for c in nb.cells if c.cell_type == "code" for o in c.outputs])
    assert "image/png" in text and "baseline" in text and "deepseek_r3" not in text
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "run_notebooks.py"), str(NOTEBOOKS[0]),
                          "--out", str(out), "--results", str(FIXTURE_RUNS), "--arms", "nope"],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode != 0 and "not recorded" in bad.stderr
