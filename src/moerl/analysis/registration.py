"""Pre-registration as tooling: an experiment's registered analysis lives in one file
(``experiments/<name>/analysis.yaml``: rules, thresholds, margins, gates, arms, rungs, seeds, evaluation
samples, which comparisons are confirmatory); every run records that file's hash when it starts
(run.json, written by moerl.tracking); the report reads its rules from that file only; and a rule whose
value was set after the first run of the grid it judges started is labelled **post hoc**, with the
commit that set it, in every table, figure and notebook that prints a verdict under it.

When was a rule's current value set? From the file's own git history (``git log --follow``): the commit
where the value last changed. Two kinds of entries reach further back, for runs recorded before the file
existed: ``registered`` (the commit where the rule was first written in code; its time is checked from
git) and ``amendments`` (each later change of the rule, with the commit that made it and the value it
replaced). An amendment stated in the file and a change seen in its history are treated alike.

When did a grid start? The earliest ``registration.started`` recorded in run.json by its runs; for grids
recorded before runs carried it, the ``first_run_started`` the file states with its evidence (sweep.json
invocations; a sweep invocation's start is a lower bound on its runs' starts, so the label errs towards
post hoc). A run that recorded an older hash of the file is judged against the rules of that version.

Nothing here decides an answer: it says under which rule a verdict was computed and whether that rule
was fixed before the data it judges existed.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

FILENAME = "analysis.yaml"
REPO = Path(__file__).resolve().parents[3]


class RegistrationError(ValueError):
    """A registered-analysis file that cannot be read as one (the message names the file and key)."""


def analysis_path(experiment: str, root: Path = REPO) -> Path:
    """``experiments/<experiment>/analysis.yaml`` under ``root``."""
    return Path(root) / "experiments" / experiment / FILENAME


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def registration_record(experiment: str, root: Path = REPO, now: dt.datetime | None = None) -> dict | None:
    """What a run records when it starts: the registered-analysis file's path, hash and the start time
    (UTC); None when the experiment has no such file. Cheap: one file read."""
    path = analysis_path(experiment, root)
    if not path.exists():
        return None
    started = (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc)
    return {"path": str(path.relative_to(root)) if path.is_relative_to(root) else str(path),
            "sha256": file_sha256(path), "started": started.isoformat(timespec="seconds")}


def load(path: Path) -> dict:
    """The registered analysis, checked for the keys the tooling reads."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RegistrationError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rules"), dict) or not isinstance(data.get("grids"), dict):
        raise RegistrationError(f"{path}: expected a mapping with 'grids' and 'rules' (see moerl.analysis.registration)")
    for rid, rule in data["rules"].items():
        if not isinstance(rule, dict) or "value" not in rule or "grids" not in rule:
            raise RegistrationError(f"{path}: rules.{rid} needs 'value' and 'grids' (the grids it judges)")
        unknown = [g for g in rule["grids"] if g not in data["grids"]]
        if unknown:
            raise RegistrationError(f"{path}: rules.{rid}.grids names {unknown[0]!r}, not one of grids: "
                                    f"{sorted(data['grids'])}")
        for i, a in enumerate(rule.get("amendments", [])):
            if not {"commit", "was", "why"} <= set(a):
                raise RegistrationError(f"{path}: rules.{rid}.amendments[{i}] needs commit, was and why")
    return data


# A fixed length, not git's %h: %h grows with the number of objects in the clone, so the same
# commit would print differently on a fresh clone and in a long-lived checkout.
SHORT_HASH_LENGTH = 8


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


def commit_time(root: Path, commit: str) -> tuple[str, dt.datetime]:
    """(short hash, committer time in UTC) of a commit; an unknown commit is an error naming it."""
    try:
        out = _git(root, "show", "-s", "--format=%H %ct", commit).split()
    except subprocess.CalledProcessError:
        raise RegistrationError(f"commit {commit!r} named in a registered analysis is not in {root}'s history") from None
    return out[0][:SHORT_HASH_LENGTH], dt.datetime.fromtimestamp(int(out[1]), dt.timezone.utc)


@dataclass
class Version:
    commit: str
    time: dt.datetime
    sha256: str
    data: dict


def file_history(path: Path, root: Path = REPO) -> list[Version]:
    """Every committed version of the file, oldest first (renames followed)."""
    rel = Path(path).resolve().relative_to(Path(root).resolve())
    log = _git(root, "log", "--follow", "--format=@@%H %ct", "--name-only", "--", str(rel))
    versions = []
    for entry in log.split("@@")[1:]:
        lines = [line for line in entry.splitlines() if line.strip()]
        if len(lines) < 2:
            continue
        commit, stamp = lines[0].split()
        blob = _git(root, "show", f"{commit}:{lines[1]}")
        try:
            data = yaml.safe_load(blob) or {}
        except yaml.YAMLError:
            data = {}
        versions.append(Version(commit[:SHORT_HASH_LENGTH], dt.datetime.fromtimestamp(int(stamp), dt.timezone.utc),
                                hashlib.sha256(blob.encode()).hexdigest(), data))
    return versions[::-1]


@dataclass
class RuleStatus:
    """Under which value a verdict was computed, and whether that value predates the grid it judges."""
    rule: str
    value: object
    set_by: str | None  # commit that set the current value (None: uncommitted)
    set_at: dt.datetime | None
    first_value: object  # the rule as first written
    first_commit: str | None
    grid_started: dt.datetime | None
    post_hoc: bool
    why: str = ""
    changes: list = field(default_factory=list)  # [(commit, time, was, why)] oldest first

    def label(self) -> str:
        """The label a table prints beside a verdict under this rule ('' when registered in time)."""
        if not self.post_hoc:
            return ""
        when = self.set_at.strftime("%Y-%m-%d %H:%M") if self.set_at else "not committed"
        return f"post hoc ({self.rule}: set by {self.set_by or 'an uncommitted edit'}, {when} UTC, after the grid started)"


def _value_changes(rid: str, versions: list[Version]) -> list[tuple[str, dt.datetime, object, str]]:
    """(commit, time, previous value, why) for each committed version where the rule's value changed."""
    out, previous = [], None
    for i, v in enumerate(versions):
        rule = (v.data.get("rules") or {}).get(rid)
        value = rule.get("value") if isinstance(rule, dict) else None
        if i and rule is not None and previous is not None and value != previous:
            out.append((v.commit, v.time, previous, "changed in the registered-analysis file"))
        if rule is not None:
            previous = value
    return out


class Registration:
    """One experiment's registered analysis and its history: rules by id, each rule's status per grid."""

    def __init__(self, path: Path, root: Path = REPO, runs: list[dict] | None = None):
        self.path, self.root = Path(path), Path(root)
        self.data = load(self.path)
        self.sha256 = file_sha256(self.path)
        try:
            self.versions = file_history(self.path, self.root)
        except (subprocess.CalledProcessError, ValueError):
            self.versions = []
        self.runs = runs or []

    @property
    def rules(self) -> dict:
        return self.data["rules"]

    def value(self, rid: str):
        if rid not in self.rules:
            raise RegistrationError(f"{self.path}: no rule {rid!r} (registered: {sorted(self.rules)})")
        return self.rules[rid]["value"]

    def grid_arms(self, grid: str) -> set[str]:
        """The arms a grid registered, each under its current name (moerl.config.RENAMED_ARMS): the file
        stays as it was written, a renamed arm's runs (loaded under the current name) still belong to it.
        A run dict may carry either name."""
        from moerl.config import current_arm

        experiment = str(self.data.get("experiment") or self.path.parent.name)
        written = self.data["grids"][grid].get("arms", [])
        return set(written) | {current_arm(experiment, a) for a in written}

    def _member(self, run: dict, grid: str) -> bool:
        """Whether ``run`` is one of the grid's registered runs: its arm and rung, and its seed and step count
        where the grid names them (a later grid of the same arm and rung on fresh seeds or another length is
        not started by the earlier grid's runs)."""
        spec = self.data["grids"][grid]
        arms, rungs = self.grid_arms(grid), set(spec.get("rungs", []))
        seeds = set(spec.get("seeds", []))
        if (arms and run.get("arm") not in arms) or (rungs and run.get("rung") not in rungs):
            return False
        if seeds and run.get("seed") is not None and run["seed"] not in seeds:
            return False
        return not (spec.get("steps") and run.get("steps_planned") is not None
                    and int(run["steps_planned"]) != int(spec["steps"]))

    def grid_started(self, grid: str) -> dt.datetime | None:
        """The grid's first run start: the earliest ``registration.started`` its runs recorded, else the
        ``first_run_started`` the file states (recorded before runs carried it); None: not started."""
        spec = self.data["grids"][grid]
        starts = []
        for run in self.runs:
            reg = run.get("registration")
            if not reg or not self._member(run, grid):
                continue
            starts.append(dt.datetime.fromisoformat(reg["started"]))
        stated = spec.get("first_run_started")
        if stated:
            t = dt.datetime.fromisoformat(str(stated))
            starts.append(t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc))
        return min(starts) if starts else None

    def _first_hash_version(self, grid: str) -> Version | None:
        """The committed version of this file whose hash the grid's earliest recording run carries."""
        recorded = sorted((r["registration"]["started"], r["registration"]["sha256"]) for r in self.runs
                          if r.get("registration") and self._member(r, grid))
        if not recorded:
            return None
        return next((v for v in self.versions if v.sha256 == recorded[0][1]), None)

    def status(self, rid: str, grid: str) -> RuleStatus:
        rule = self.rules[rid]
        if grid not in rule["grids"]:
            raise RegistrationError(f"{self.path}: rules.{rid} does not judge grid {grid!r} (it judges {rule['grids']})")
        changes = []
        if rule.get("registered"):
            first_commit, first_time = commit_time(self.root, str(rule["registered"]))
        elif self.versions and any(rid in (v.data.get("rules") or {}) for v in self.versions):
            first = next(v for v in self.versions if rid in (v.data.get("rules") or {}))
            first_commit, first_time = first.commit, first.time
        else:
            first_commit, first_time = None, None
        for a in rule.get("amendments", []):
            commit, time = commit_time(self.root, str(a["commit"]))
            changes.append((commit, time, a["was"], a["why"]))
        changes += _value_changes(rid, self.versions)
        changes.sort(key=lambda c: c[1])
        committed = [v for v in self.versions if v.sha256 == self.sha256]
        uncommitted = bool(self.versions) and not committed and self._current_differs(rid)
        if uncommitted:
            set_by, set_at = None, None
        elif changes:
            set_by, set_at = changes[-1][0], changes[-1][1]
        else:
            set_by, set_at = first_commit, first_time
        first_value = changes[0][2] if changes else rule["value"]
        started = self.grid_started(grid)
        post_hoc, why = False, ""
        if started is not None:
            if set_by is None and (uncommitted or first_commit is None):
                post_hoc, why = True, "the rule is not committed, the grid has started"
            elif set_at is not None and set_at > started:
                post_hoc, why = True, f"set {set_at:%Y-%m-%d %H:%M:%S}, grid started {started:%Y-%m-%d %H:%M:%S} UTC"
            base = self._first_hash_version(grid)
            if base is not None:
                registered = (base.data.get("rules") or {}).get(rid, {}).get("value")
                if registered != rule["value"]:
                    post_hoc = True
                    why = why or f"the grid's first run recorded version {base.commit} of the file, where it read {registered!r}"
                    first_value = registered
        return RuleStatus(rid, rule["value"], set_by, set_at, first_value, first_commit, started, post_hoc, why, changes)

    def _current_differs(self, rid: str) -> bool:
        last = (self.versions[-1].data.get("rules") or {}).get(rid) if self.versions else None
        return not isinstance(last, dict) or last.get("value") != self.rules[rid]["value"]

    def labels(self, rids: list[str], grid: str) -> str:
        """One label for a verdict computed under several rules: every post-hoc one, '' if none."""
        found = [self.status(r, grid) for r in rids]
        return "; ".join(s.label() for s in found if s.post_hoc)

    def timeline(self, started_only: bool = False, grids: set[str] | None = None, header: bool = True) -> list[str]:
        """Markdown lines: each rule with its registration, its amendments and, per grid it judges,
        whether its current value is pre-registered or post hoc there (``started_only``: grids with runs;
        ``grids``: only these; ``header``: the table's two header lines first)."""
        lines = []
        for rid, rule in self.rules.items():
            for grid in rule["grids"]:
                if grids is not None and grid not in grids:
                    continue
                s = self.status(rid, grid)
                if started_only and s.grid_started is None:
                    continue
                start = f"{s.grid_started:%Y-%m-%d %H:%M} UTC" if s.grid_started else "not started"
                history = "; ".join(f"{c} ({t:%m-%d %H:%M}) replaced {was!r}: {why}" for c, t, was, why in s.changes)
                lines.append(f"| {rid} | {grid} (first run {start}) | `{json.dumps(s.value, default=str)}` | "
                             f"{s.first_commit or '—'} | {history or '—'} | "
                             f"{'**post hoc** — ' + s.why if s.post_hoc else 'pre-registered'} |")
        head = ["| rule | grid | value | first written | amendments | status |", "|---|---|---|---|---|---|"]
        return (head if header else []) + lines


# Keys that change what a run *measures* or how long it runs, not what its training computes step by step: a
# registered run whose identity differs from an earlier run's only in these, with the same seed, repeats that
# run's training bit for bit (its first min(steps) steps), so its outcome was partly seen before registration.
MEASUREMENT_KEYS = ("trainer.eval_samples", "trainer.eval_size", "trainer.eval_every", "trainer.steps",
                    "trainer.samples_every", "trainer.samples_per_save")


def same_training(a: dict, b: dict) -> bool:
    """Whether two recorded identities (run.json ``identity``) train alike: equal on every key both record
    except MEASUREMENT_KEYS (a key one side lacks was added to the config after that run and left at its default)."""
    return all(a[k] == b[k] for k in set(a) & set(b) if k not in MEASUREMENT_KEYS)


def repeats(runs: list[dict]) -> list[dict]:
    """Registered runs that repeat an earlier unregistered run: for each run with ``registered`` true, the runs
    with ``registered`` false, the same seed and the same training (``identity``, :func:`same_training`).
    Each entry names both runs and how many steps they share (``steps``: the shorter run's length)."""
    earlier = [r for r in runs if not r.get("registered") and r.get("identity")]
    out = []
    for run in runs:
        if not run.get("registered") or not run.get("identity"):
            continue
        for old in earlier:
            if old["seed"] == run["seed"] and same_training(old["identity"], run["identity"]):
                out.append({"run": run["run_dir"], "repeats": old["run_dir"], "seed": run["seed"],
                            "steps": min(int(old["steps_planned"]), int(run["steps_planned"]))})
                break
    return out
