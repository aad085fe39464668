"""scripts/compare_runs.py: run directories (or globs, or an experiment's arms) overlaid in one figure and
one table row per run; smoke runs only when named. And the one wandb sync command of a resumed run."""
from __future__ import annotations

import shutil

import pytest

from tests_helpers import REPO, load_script

compare = load_script("scripts/compare_runs.py", "compare_runs")
FIXTURE = REPO / "tests" / "fixtures" / "runs" / "00_tiny_moe_cpu"


def _rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| run ")]


def test_two_run_directories_give_one_figure_and_a_row_each(tmp_path, capsys):
    png = tmp_path / "cmp.png"
    assert compare.main([str(FIXTURE / "baseline" / "seed0"), str(FIXTURE / "r3" / "seed0"), "--out", str(png)]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert [r.split(" | ")[0] for r in rows] == ["| baseline/seed0", "| r3/seed0"]
    header = out.splitlines()[0].split(" | ")
    assert len(header) <= 8 and "k3 (median)" in header and "clip fraction (median)" in out and "IS p99" in out
    assert png.stat().st_size > 10_000


def test_smoke_runs_are_left_out_unless_named_and_globs_expand(tmp_path, capsys):
    root = tmp_path / "runs" / "00_tiny_moe_cpu"
    shutil.copytree(FIXTURE / "baseline" / "seed0", root / "baseline" / "seed0")
    shutil.copytree(FIXTURE / "r3" / "seed0", tmp_path / "runs" / "smoke" / "00_tiny_moe_cpu" / "r3" / "seed0")
    compare.main([str(tmp_path / "runs"), "--out", str(tmp_path / "a.png")])
    assert [r.split(" | ")[0] for r in _rows(capsys.readouterr().out)] == ["| baseline/seed0"]
    compare.main([str(tmp_path / "runs" / "smoke"), str(root), "--out", str(tmp_path / "b.png")])
    assert len(_rows(capsys.readouterr().out)) == 2
    compare.main([str(tmp_path / "runs" / "*" / "baseline" / "seed0"), "--out", str(tmp_path / "c.png")])
    assert len(_rows(capsys.readouterr().out)) == 1


def test_an_experiment_and_arm_names_still_work_and_a_missing_arm_is_named(tmp_path, capsys):
    compare.main([str(FIXTURE), "r3", "--out", str(tmp_path / "d.png")])
    assert all("r3/" in r for r in _rows(capsys.readouterr().out))
    with pytest.raises(SystemExit, match=r"no run for arm\(s\) \['tis'\]"):
        compare.main([str(FIXTURE), "tis", "--out", str(tmp_path / "e.png")])
    with pytest.raises(SystemExit, match="no such run directory"):
        compare.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "f.png")])


def test_a_resumed_run_syncs_into_one_wandb_run(tmp_path):
    from moerl.tracking import wandb_sync_command

    assert wandb_sync_command(tmp_path) is None
    (tmp_path / "wandb_id.txt").write_text("ab12cd34\n")
    first = tmp_path / "wandb" / "offline-run-20261207_010000-ab12cd34"
    first.mkdir(parents=True)
    assert wandb_sync_command(tmp_path) == f"wandb sync {first}"
    resumed = tmp_path / "wandb" / "offline-run-20261207_020000-ab12cd34"
    resumed.mkdir()
    assert wandb_sync_command(tmp_path) == f"wandb sync --id ab12cd34 {first} {resumed}"
