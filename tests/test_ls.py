"""scripts/ls.py lists every experiment and every arm with a description and what its loss really is."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests_helpers import load_script

REPO = Path(__file__).resolve().parents[1]
ls = load_script("scripts/ls.py", "moerl_ls_script")


def test_every_experiment_is_listed_with_its_launcher(capsys):
    assert ls.main([]) == 0
    out = capsys.readouterr().out
    for exp in sorted(p.name for p in (REPO / "experiments").iterdir() if p.name[:2].isdigit()):
        assert exp in out
    assert "experiments/06_routing_geometry/run.sh" in out and "GPU cluster (verl)" in out


@pytest.mark.parametrize("experiment, arm, label", [("00", "geo_mis_3pct", "geometric MIS [0.97, 1.03], veto 0.0001"),
                                                    ("05", "seq_mis", "sequence MIS [0.5, 2]"),
                                                    ("07", "geo_mis_0p1pct", "geometric MIS [0.999, 1.001]")])
def test_each_arm_is_described_and_mis_says_which_estimator(experiment, arm, label, capsys):
    assert ls.main([experiment]) == 0
    out = capsys.readouterr().out
    exp_dir = next((REPO / "experiments").glob(f"{experiment}_*"))
    arms = {p.stem for p in (exp_dir / "arms").glob("*.yaml")}
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    assert listed == arms
    mis = next(line for line in out.splitlines() if line.split()[:1] == [arm])
    assert label in mis and "(formerly mis)" in mis  # the old name is shown where the arm is listed


def test_unknown_experiment_names_the_ones_there_are():
    with pytest.raises(SystemExit, match="experiment '9': not found .*07_dose_threshold"):
        ls.main(["9"])
