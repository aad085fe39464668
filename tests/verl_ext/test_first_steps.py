"""scripts/check_first_steps.py: moerl's own CPU runs, rewritten under verl's metric names and log
formats, pass; one crafted log per invariant fails for exactly that invariant."""
from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path

import pytest

from moerl.analysis.results import VERL_METRIC_MAP
from moerl.verl_ext import first_steps as fs

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "results" / "runs" / "00_tiny_moe_cpu"
TO_VERL = {v: k for k, v in VERL_METRIC_MAP.items() if v != "step"}

_spec = importlib.util.spec_from_file_location("check_first_steps", REPO / "scripts" / "check_first_steps.py")
cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli)


def _verl_steps(run: str, steps=(1, 2, 3)) -> dict[int, dict]:
    """A moerl run's first steps under verl's names (what verl would log), without moerl's
    refit/version so the refit invariant is judged from k3 and ppo_kl as on verl."""
    rows = fs.by_step(fs.read_rows(RUNS / run))
    return {s: {TO_VERL.get(k, k): v for k, v in rows[s].items() if k not in ("step", "refit/version")}
            for s in steps}


def _write_jsonl(path: Path, steps: dict[int, dict]) -> Path:
    """verl's FileLogger format; NaN/inf become null as orjson writes them."""
    clean = {s: {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
             for s, d in steps.items()}
    path.write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in clean.items()))
    return path


def _write_console(path: Path, steps: dict[int, dict]) -> Path:
    """verl's console format (verl/utils/logger/aggregate_logger.py concat_dict_to_str)."""
    from verl.utils.logger.aggregate_logger import concat_dict_to_str

    path.write_text("(TaskRunner pid=1) some start-up line\n" +
                    "".join(f"(TaskRunner pid=1) {concat_dict_to_str(d, step=s)}\n" for s, d in steps.items()))
    return path


def _failed(path, *args) -> set[str]:
    return {v.name for v in fs.check(fs.read_rows(path), *args) if not v.ok}


def test_floors_are_the_ones_the_cpu_runs_give():
    assert fs.derive_floors(RUNS) == fs.BF16_K3_FLOOR


@pytest.mark.parametrize("run,family,r3", [("baseline/seed1", "qwen3_moe", False), ("r3/seed0", "qwen3_moe", True),
                                           ("deepseek_r3/seed0", "deepseek_v3", True)])
def test_moerl_runs_pass_in_every_format(tmp_path, run, family, r3):
    assert fs.family_and_r3(RUNS / run) == (family, r3)
    assert cli.main([str(RUNS / run)]) == 0  # moerl's own metrics.jsonl
    steps = _verl_steps(run)
    for path in (_write_jsonl(tmp_path / "run.jsonl", steps), _write_console(tmp_path / "run.log", steps)):
        assert cli.main([str(path), "--family", family] + (["--r3"] if r3 else [])) == 0, path


def test_every_cpu_run_of_experiment_00_passes():
    for d in sorted(RUNS.glob("*/seed*")):
        fam, r3 = fs.family_and_r3(d)
        bad = [v for v in fs.check(fs.read_rows(d), fam, r3) if not v.ok]
        assert not bad, (d, bad)


def _crafted(tmp_path, edit, fmt="jsonl", run="baseline/seed1"):
    steps = copy.deepcopy(_verl_steps(run))
    edit(steps)
    return (_write_jsonl if fmt == "jsonl" else _write_console)(tmp_path / f"bad.{fmt}", steps)


def _set(step, key, value):
    def edit(steps):
        steps[step][key] = value
    return edit


CRAFTED = {
    # rollout and trainer differ at step 1 although adapter B = 0 (e.g. a wrong weight load)
    "k3_floor": (_set(1, "rollout_corr/k3_kl", 0.05), False),
    # replay rows reached the wrong router at step 2
    "r3": (_set(2, fs.R3_AGREEMENT, 0.97), True),
    # the rollout kept the step-0 weights: step-2 k3 carries the step-1 update
    "refit": (lambda s: (s[1].__setitem__("actor/ppo_kl", 0.03), s[2].__setitem__("rollout_corr/k3_kl", 0.02)), False),
    "finite": (_set(2, "actor/grad_norm", float("nan")), False),
}


@pytest.mark.parametrize("fmt", ["jsonl", "console"])
@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_each_crafted_log_fails_for_its_own_reason(tmp_path, name, fmt):
    edit, r3 = CRAFTED[name]
    run = "r3/seed0" if r3 else "baseline/seed1"
    path = _crafted(tmp_path, edit, fmt, run)
    assert _failed(path, "qwen3_moe", r3) == {name}
    assert cli.main([str(path), "--family", "qwen3_moe"] + (["--r3"] if r3 else [])) == 1


def test_r3_violation_and_unlogged_agreement_fail(tmp_path):
    path = _crafted(tmp_path, _set(1, "replay/violations", 3), run="r3/seed0")
    assert _failed(path, "qwen3_moe", True) == {"r3"}
    unlogged = _crafted(tmp_path, lambda s: [d.pop(k, None) for d in s.values()
                                             for k in (fs.R3_AGREEMENT, *fs.R3_VIOLATIONS)], run="r3/seed0")
    assert _failed(unlogged, "qwen3_moe", True) == {"r3"}  # verl 0.9.1 logs no agreement: not silently ok
    assert cli.main([str(unlogged), "--family", "qwen3_moe", "--r3", "--r3-unlogged-ok"]) == 0


def test_refit_version_that_does_not_advance_fails(tmp_path):
    rows = [json.loads(line) for line in (RUNS / "r3/seed0/metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r.get("step") == 2 and "refit/version" in r:
            r["refit/version"] = 1.0
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text((RUNS / "r3/seed0/config.yaml").read_text())
    assert cli.main([str(run)]) == 1
    assert _failed(run, "qwen3_moe", True) == {"refit"}


def test_experiment_gives_family_and_r3_mode_and_wandb_runs_are_read():
    assert fs.family_and_r3("x", REPO / "experiments/04_moonlight_16b_a3b_r3") == ("deepseek_v3", True)
    assert fs.family_and_r3("x", REPO / "experiments/03_qwen3_30b_a3b_lora_mitigations/arms/r3.yaml") == (
        "qwen3_moe", True)
    assert fs.family_and_r3("x", REPO / "experiments/01_kimi_k2_lora_grpo") == ("deepseek_v3", False)
    steps = _verl_steps("baseline/seed1")
    rows = [{"_step": s, **d} for s, d in steps.items()] + [{"_step": 2, "val-core/math/acc/mean@1": 0.1}]

    class Api:  # wandb.Api stand-in: scan_history yields only the keys each row logged
        def run(self, path):
            assert path == "ent/proj/abc"
            return type("Run", (), {"scan_history": lambda self: iter(rows)})()

    assert cli.main(["wandb:ent/proj/abc", "--family", "qwen3_moe"], api=Api()) == 0
    rows[1]["actor/grad_norm"] = float("nan")
    assert cli.main(["wandb:ent/proj/abc", "--family", "qwen3_moe"], api=Api()) == 1


def test_unreadable_run_exits_2(tmp_path):
    assert cli.main([str(tmp_path / "missing.jsonl"), "--family", "qwen3_moe"]) == 2
