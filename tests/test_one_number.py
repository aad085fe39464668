"""One number per quantity: where the README, RESULTS.md, a notebook's answer and a figure print the same
quantity, they print the same value (the examples a reader found differing: baseline k3 3.91e-4 in the README
vs 4.02e-4 in notebook 01; "tokens routed alike" 0.9831 in the table under a figure drawing 0.9954 of another
metric)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "results" / "runs"
EXP = "00_tiny_moe_cpu"


def _table_row(text: str, header_start: str, arm: str) -> dict[str, str]:
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    names = [c.strip() for c in lines[head].strip("|").split("|")]
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == arm:
            return dict(zip(names, cells))
    raise AssertionError(f"no row {arm} under {header_start!r}")


@pytest.fixture(scope="module")
def recorded():
    from moerl.analysis.results import family_references, load_experiment, load_summaries

    df = load_experiment(EXP, RUNS, None)
    runs = load_summaries(RUNS, EXP)
    return df[df["reward/mean"].notna()], runs, family_references(runs)


def test_baseline_k3_reads_the_same_in_readme_results_and_notebook_01(recorded):
    from moerl.analysis import answers

    train, _, references = recorded
    readme = _table_row((REPO / "README.md").read_text(), "| arm | k3, run median", "baseline")
    results = _table_row((REPO / "results" / "RESULTS.md").read_text(), "| arm | seeds | k3 KL (run median)", "baseline")
    k3 = readme["k3, run median (mean of seeds)"]
    assert results["k3 KL (run median)"].startswith(k3 + " ")
    notebook = re.search(r"baseline (\d\.\d\de-\d\d)", answers.mismatch(train, references)).group(1)
    assert notebook == k3


def test_tokens_routed_alike_reads_the_same_in_readme_results_and_the_summary_figure(recorded):
    from moerl.analysis import plots

    _, runs, references = recorded
    readme = _table_row((REPO / "README.md").read_text(), "| arm | k3, run median", "baseline")
    results = _table_row((REPO / "results" / "RESULTS.md").read_text(), "| arm | seeds | k3 KL (run median)", "baseline")
    alike = readme["tokens routed alike in every MoE layer"]
    assert results["tokens agreeing in all layers"].startswith(alike + " ")
    fig = plots.summary_figure(runs, "t", k3_key="mean/mismatch/k3", references=references)
    route_axis = fig.axes[1]
    assert "tokens routed alike in every MoE layer" in route_axis.get_xlabel()
    drawn = {t.get_text() for t in route_axis.texts}
    assert alike in drawn and route_axis.get_xlim()[1] <= 1.0
    plots.plt.close(fig)


def test_results_md_tables_of_00_and_05_are_at_most_eight_columns():
    text = (REPO / "results" / "RESULTS.md").read_text()
    for experiment in ("00_tiny_moe_cpu", "05_mismatch_consequences"):
        section = text.split(f"## {experiment}", 1)[1].split("\n## ", 1)[0]
        headers = [line for i, line in enumerate(section.splitlines()[:-1])
                   if line.startswith("| ") and section.splitlines()[i + 1].startswith("|---")]
        assert headers and all(len(h.strip("|").split(" | ")) <= 8 for h in headers), experiment
