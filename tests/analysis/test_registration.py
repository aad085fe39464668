"""Pre-registration as tooling: a rule edited after a grid's first run is labelled post hoc, from the
registered-analysis file's git history and the hash and start time each run records."""
import datetime as dt
import json
import os
import subprocess

import pytest
import yaml

from moerl.analysis.registration import (SHORT_HASH_LENGTH, Registration, RegistrationError, analysis_path,
                                        registration_record)

UTC = dt.timezone.utc


def at(hour, minute=0):
    return dt.datetime(2026, 1, 1, hour, minute, tzinfo=UTC)


def commit(root, when, message):
    env = {**os.environ, "GIT_AUTHOR_DATE": when.isoformat(), "GIT_COMMITTER_DATE": when.isoformat(),
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(root), "commit", "-qm", message], check=True, env=env)
    full = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    return full[:SHORT_HASH_LENGTH]


def write(path, margin):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"experiment": "x", "grids": {"main": {"arms": ["r3"], "seeds": [0, 1, 2]}},
                                    "rules": {"margin": {"value": margin, "grids": ["main"]},
                                              "floor": {"value": 0.01, "grids": ["main"]}}}))


@pytest.fixture
def repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    return tmp_path


def test_a_rule_edited_after_the_first_run_is_post_hoc(repo):
    path = analysis_path("x", repo)
    write(path, 0.05)
    first = commit(repo, at(1), "register")
    run = {"arm": "r3", "rung": None, "registration": registration_record("x", repo, now=at(2))}
    assert run["registration"]["sha256"] == Registration(path, repo).sha256
    reg = Registration(path, repo, runs=[run])
    assert not reg.status("margin", "main").post_hoc and reg.labels(["margin", "floor"], "main") == ""
    assert reg.status("margin", "main").set_by == first

    write(path, 0.08)  # edited after the run started, not committed yet
    reg = Registration(path, repo, runs=[run])
    status = reg.status("margin", "main")
    assert status.post_hoc and status.set_by is None and "uncommitted" in status.label()
    assert not reg.status("floor", "main").post_hoc  # the untouched rule stays pre-registered

    amendment = commit(repo, at(3), "widen the margin")
    reg = Registration(path, repo, runs=[run])
    status = reg.status("margin", "main")
    assert status.post_hoc and status.set_by == amendment and status.first_value == 0.05
    assert f"set by {amendment}" in reg.labels(["margin", "floor"], "main")
    assert "post hoc" in "\n".join(reg.timeline())


def test_the_timeline_lists_only_started_grids_of_those_asked(repo):
    """The report joins two timelines (the earlier grids, the grids on the registered rollout path): each
    keeps to its grids, and only the first brings the table's header."""
    path = analysis_path("x", repo)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"experiment": "x", "grids": {"old": {"arms": ["r3"]}, "new": {"arms": ["tis"]}},
                                    "rules": {"margin": {"value": 0.05, "grids": ["old", "new"]}}}))
    commit(repo, at(1), "register")
    run = {"arm": "tis", "rung": None, "registration": registration_record("x", repo, now=at(2))}
    reg = Registration(path, repo, runs=[run])
    assert [line.split(" | ")[1] for line in reg.timeline(started_only=True)[2:]] == ["new (first run 2026-01-01 02:00 UTC)"]
    assert reg.timeline(started_only=True, grids={"old"}) == reg.timeline()[:2]  # header only: "old" has no run
    rows = reg.timeline(grids={"new"}, header=False)
    assert len(rows) == 1 and rows[0].startswith("| margin | new ")


def test_a_run_that_recorded_an_older_version_is_judged_against_it(repo):
    path = analysis_path("x", repo)
    write(path, 0.05)
    commit(repo, at(1), "register")
    run = {"arm": "r3", "registration": registration_record("x", repo, now=at(5))}
    write(path, 0.08)
    # committed with a date *before* the run's start (a rebased or back-dated commit): the hash still tells
    commit(repo, at(2), "edit")
    status = Registration(path, repo, runs=[run]).status("margin", "main")
    assert status.post_hoc and status.first_value == 0.05 and "recorded version" in status.why


def test_stated_amendments_and_grid_start_for_runs_recorded_before_hashes(repo):
    (repo / "code.py").write_text("MARGIN = 0.05\n")
    written = commit(repo, at(1), "rule in code")
    (repo / "code.py").write_text("MARGIN = 0.08\n")
    amended = commit(repo, at(4), "amend in code")
    path = analysis_path("x", repo)
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump({
        "grids": {"main": {"first_run_started": "2026-01-01T02:00:00+00:00"}},
        "rules": {"margin": {"value": 0.08, "grids": ["main"], "registered": written,
                             "amendments": [{"commit": amended, "was": 0.05, "why": "after seed 2"}]}}}))
    commit(repo, at(6), "registered analysis, reconstructed")
    status = Registration(path, repo).status("margin", "main")
    assert status.post_hoc and status.set_by == amended and status.first_value == 0.05
    assert status.first_commit == written


def test_bad_file_is_one_clear_error(tmp_path):
    path = tmp_path / "analysis.yaml"
    path.write_text(yaml.safe_dump({"grids": {"main": {}}, "rules": {"m": {"value": 1, "grids": ["other"]}}}))
    with pytest.raises(RegistrationError, match=r"analysis.yaml: rules.m.grids names 'other'"):
        Registration(path, tmp_path)


def test_every_run_records_the_registration(tmp_path, tiny_cfg):
    from moerl.tracking import Tracker

    tiny_cfg.experiment = "07_dose_threshold"
    tracker = Tracker(tmp_path / "run", tiny_cfg)
    tracker.close()
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())["registration"]
    assert recorded["path"] == "experiments/07_dose_threshold/analysis.yaml"
    assert recorded["sha256"] == Registration(analysis_path("07_dose_threshold")).sha256
    # a resume keeps what the run started under
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    Tracker(tmp_path / "run", tiny_cfg, resume_step=1).close()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["registration"] == recorded


def test_registered_values_are_the_ones_the_code_uses():
    """Rules shared with experiment 05's code (collapse, drift, the acted-on floor) are registered with the
    values the code computes with: changing one without the other fails here."""
    from moerl.analysis import collapse, dose, verdicts

    assert dose.registered("collapse") == {"window": collapse.WINDOW, "fraction": collapse.FRACTION,
                                           "nonfinite_update": True}
    assert dose.registered("drift") == {"window": verdicts.EARLY_LATE_WINDOW, "growth": verdicts.DRIFT_GROWTH}
    assert dose.ACTS_ON_FLOOR == verdicts.ACTS_ON_MIN
    e05 = yaml.safe_load(analysis_path("05_mismatch_consequences").read_text())["rules"]
    assert e05["verdict_gates"]["value"]["acts_on_floor"] == verdicts.ACTS_ON_MIN
    assert e05["collapse"]["value"] == dose.registered("collapse")


def test_a_later_grid_on_fresh_seeds_is_not_started_by_an_earlier_grids_runs(repo):
    """Two grids of one arm and rung: the earlier grid's runs (other seeds, other length) do not start the
    later one, so a rule registered for it before its own first run stays pre-registered."""
    path = analysis_path("x", repo)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"experiment": "x", "grids": {
        "old": {"arms": ["baseline"], "rungs": ["int4_experts"], "seeds": [0, 1], "steps": 300},
        "new": {"arms": ["baseline"], "rungs": ["int4_experts"], "seeds": [12, 13], "steps": 600}},
        "rules": {"reading": {"value": "holm", "grids": ["new"]}}}))
    commit(repo, at(5), "register the new grid")
    old_run = {"arm": "baseline", "rung": "int4_experts", "seed": 0, "steps_planned": 300,
               "registration": registration_record("x", repo, now=at(1))}
    reg = Registration(path, repo, runs=[old_run])
    assert reg.grid_started("new") is None and reg.grid_started("old") == at(1)
    assert not reg.status("reading", "new").post_hoc
    new_run = {**old_run, "seed": 12, "steps_planned": 600, "registration": registration_record("x", repo, now=at(6))}
    assert Registration(path, repo, runs=[old_run, new_run]).grid_started("new") == at(6)


def test_a_registered_run_repeating_an_earlier_run_is_found():
    """Same training config and seed as a run read before registration, only the evaluation size or the length
    differing: the registered run repeats it (its first min(steps) steps); another seed or another rung does not."""
    from moerl.analysis.registration import repeats

    identity = {"arm": "r3", "rollout.dtype": "fp8", "trainer.eval_samples": 4, "trainer.steps": 300, "seed": 0}
    old = {"run_dir": "old/seed0", "seed": 0, "steps_planned": 300, "registered": False, "identity": identity}
    new = {"run_dir": "new/seed0", "seed": 0, "steps_planned": 600, "registered": True,
           "identity": {**identity, "trainer.eval_samples": 8, "trainer.steps": 600, "trainer.fake_quant": "none"}}
    fresh = {**new, "run_dir": "new/seed5", "seed": 5, "identity": {**new["identity"], "seed": 5}}
    other = {**new, "run_dir": "other/seed0", "identity": {**new["identity"], "rollout.dtype": "nvfp4"}}
    assert repeats([old, new, fresh, other]) == [{"run": "new/seed0", "repeats": "old/seed0", "seed": 0, "steps": 300}]
