"""scripts/check_first_steps.py: moerl's own CPU runs, rewritten under verl's metric names and log
formats, pass; one crafted log per invariant fails for exactly that invariant."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from moerl.analysis.results import VERL_METRIC_MAP
from moerl.verl_ext import first_steps as fs
from tests_helpers import load_script, verl_adapter_tensors

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "results" / "runs" / "00_tiny_moe_cpu"
TO_VERL = {v: k for k, v in VERL_METRIC_MAP.items() if v != "step"}

cli = load_script("scripts/check_first_steps.py", "check_first_steps")


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


def _stale(steps):
    """The rollout kept the step-0 weights: each step's k3 carries every update so far (>= 2 x summed ppo_kl)."""
    f = steps[1]["rollout_corr/k3_kl"]
    steps[1]["actor/ppo_kl"] = steps[2]["actor/ppo_kl"] = 0.03
    steps[2]["rollout_corr/k3_kl"], steps[3]["rollout_corr/k3_kl"] = f + 0.065, f + 0.13


def _grown(steps):
    """k3 grows past twice the floor once LoRA B != 0, by less than a stale rollout would show."""
    steps[1]["actor/ppo_kl"] = 0.02
    steps[2]["rollout_corr/k3_kl"] = steps[3]["rollout_corr/k3_kl"] = 0.01


CRAFTED = {
    # rollout and trainer differ at step 1 although adapter B = 0 (e.g. a wrong weight load)
    "k3_floor": (_set(1, "rollout_corr/k3_kl", 0.05), False, {"k3_floor"}),
    # replay rows reached the wrong router at step 2
    "r3": (_set(2, fs.R3_AGREEMENT, 0.97), True, {"r3"}),
    # a stale rollout grows the mismatch too: both name it
    "refit": (_stale, False, {"refit", "mismatch_growth"}),
    # an adapter delta applied differently on the two sides (e.g. a shared-expert LoRA summed over TP)
    "mismatch_growth": (_grown, False, {"mismatch_growth"}),
    "finite": (_set(2, "actor/grad_norm", float("nan")), False, {"finite"}),
}


@pytest.mark.parametrize("fmt", ["jsonl", "console"])
@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_each_crafted_log_fails_for_its_own_reason(tmp_path, name, fmt):
    edit, r3, expected = CRAFTED[name]
    run = "r3/seed0" if r3 else "baseline/seed1"
    path = _crafted(tmp_path, edit, fmt, run)
    assert _failed(path, "qwen3_moe", r3) == expected
    assert cli.main([str(path), "--family", "qwen3_moe"] + (["--r3"] if r3 else [])) == 1


def test_growth_factor_holds_every_healthy_cpu_run_with_the_floor_margin():
    assert fs.derive_growth_factor(RUNS) <= fs.GROWTH_FACTOR


GPU_K3 = 1.5e-3  # step-1 k3 at GPU scale (R3 paper, Qwen3-30B-A3B without R3)


def _gpu_log(lr: float, stale: bool, versions: bool = False) -> dict[int, dict]:
    """Five steps as verl logs them at GPU scale: ppo_kl 1e-4 per step at lr 1e-5, scaling with lr^2
    (the KL of an Adam step); a healthy k3 scatters 10 % around its step-1 value, a stale one adds
    2.7 x the summed ppo_kl (4 mini-batches, independent directions: the smallest a stale rollout adds)."""
    kl = 1e-4 * (lr / 1e-5) ** 2
    steps = {}
    for k in range(1, 6):
        k3 = GPU_K3 * (1 + 0.1 * (-1) ** k * (k > 1)) + (2.7 * kl * (k - 1) if stale else 0.0)
        steps[k] = {"rollout_corr/k3_kl": k3, "actor/ppo_kl": kl, "actor/grad_norm": 0.3, "actor/lr": lr}
        if versions:
            steps[k]["refit/version"] = 0.0 if stale else float(k)
    return steps


@pytest.mark.parametrize("lr", [1e-4, 1e-5, 1e-6])
def test_refit_is_decided_at_lr_1e4_and_1e5_by_k3_and_at_1e6_only_by_the_version(tmp_path, lr):
    def refit(steps, **kw):
        path = _write_jsonl(tmp_path / f"{lr}.jsonl", steps)
        return next(v for v in fs.check(fs.read_rows(path), "qwen3_moe", False, floor=2e-3, **kw)
                    if v.name == "refit")

    healthy, stale = refit(_gpu_log(lr, False)), refit(_gpu_log(lr, True))
    if lr >= 1e-5:  # the summed update clears the band by step 5 (lr 1e-5) or step 2 (lr 1e-4)
        assert healthy.ok and "follows the updated policy" in healthy.detail, healthy.detail
        assert not stale.ok and "step-0 weights" in stale.detail, stale.detail
    else:  # 4e-6 of summed KL hides in the numerics: the log cannot tell, and says so instead of passing
        for v in (healthy, stale):
            assert not v.ok and v.detail.startswith("undecided") and "refit/version" in v.detail, v.detail
        assert refit(_gpu_log(lr, False), refit_undecided_ok=True).ok
    # refit/version decides at every learning rate
    assert refit(_gpu_log(lr, False, versions=True)).ok
    stuck = refit(_gpu_log(lr, True, versions=True))
    assert not stuck.ok and "did not advance from step 1->2" in stuck.detail


LOST = "base_model.model.model.layers.1.mlp.experts.down_proj.lora_B.weight"


def _side_log(path: Path, lr: float = 1e-6, stale_at=None, skip=None, partial_at=None, ranks=(0, 1)) -> Path:
    """A side log as moerl.verl_ext.refit_log writes it (its own row code): the base sync, then one adapter
    update per step 0-5 per rank. ``stale_at``: that step resends the previous step's LoRA; ``skip``: that
    step sends nothing; ``partial_at``: rank 1 leaves one tensor out at that step."""
    from moerl.verl_ext import refit_log

    stub = type("Adapter", (), {"replica_rank": 0, "rollout_rank": 0})()
    for rank in ranks:
        refit_log._first_names.clear()  # each rank is its own process
        base = refit_log.Update(stub, 0, "named_tensors", {"peft_config": {}, "base_sync_done": False})
        base.see("model.embed_tokens.weight", verl_adapter_tensors(0, lr)[LOST])
        refit_log.append_row(path, {**base.row(), "rank": rank})
        for step in range(6):
            if step == skip:
                continue
            tensors = verl_adapter_tensors(step - 1 if step == stale_at else step, lr)
            if step == partial_at and rank == 1:
                tensors.pop(LOST)
            update = refit_log.Update(stub, step, "named_tensors", {"peft_config": {}, "base_sync_done": True})
            for name, t in tensors.items():
                update.see(name, t)
            refit_log.append_row(path, {**update.row(), "rank": rank})
    return path


def _refit_verdict(tmp_path, **side):
    """scripts/check_first_steps.py on a five-step verl log at lr 1e-6 (k3 cannot tell) with the side log
    found beside it."""
    run = _write_jsonl(tmp_path / "run.jsonl", _gpu_log(1e-6, False))
    _side_log(tmp_path / "run.refit.jsonl", **side)
    verdicts = fs.check(fs.read_rows(run), "qwen3_moe", False, floor=2e-3,
                        refit_log=fs.read_refit_log(tmp_path / "run.refit.jsonl"))
    code = cli.main([str(run), "--family", "qwen3_moe", "--floor", "2e-3"])
    return next(v for v in verdicts if v.name == "refit"), code


def test_side_log_decides_the_refit_at_lr_1e6(tmp_path):
    healthy, code = _refit_verdict(tmp_path)
    assert healthy.ok and code == 0, healthy.detail  # no --refit-undecided-ok needed
    assert "changed the LoRA checksum" in healthy.detail and "ranks 0, 1" in healthy.detail


@pytest.mark.parametrize("fault,side,reason", [
    ("stale", {"stale_at": 3}, "stale: the update after step 3 has the checksum of the update after step 2 "
                               "on ranks 0, 1"),
    ("missing", {"skip": 3}, "no update after step 3 (global_steps=3, the weights step 4's rollout samples from) "
                             "on ranks 0, 1"),
    ("partial", {"partial_at": 2}, f"partial refit: the update after step 2 sends 3 tensors whose names differ "
                                   f"from the first update's 4 on rank 1 (-{LOST})"),
])
def test_side_log_names_a_stale_missing_or_partial_refit(tmp_path, fault, side, reason):
    verdict, code = _refit_verdict(tmp_path, **side)
    assert not verdict.ok and code == 1 and reason in verdict.detail, verdict.detail


def test_side_log_given_by_flag_or_unreadable(tmp_path, capsys):
    run = _write_jsonl(tmp_path / "run.jsonl", _gpu_log(1e-6, False))
    log = _side_log(tmp_path / "elsewhere" / "run_seed2.refit.jsonl", stale_at=2)
    assert cli.main([str(run), "--family", "qwen3_moe", "--floor", "2e-3", "--refit-log", str(log)]) == 1
    assert "stale: the update after step 2" in capsys.readouterr().out
    log.write_text(log.read_text() + '{"step": 3}\n')
    assert cli.main([str(run), "--family", "qwen3_moe", "--refit-log", str(log)]) == 2
    assert "not a refit side-log row" in capsys.readouterr().err
    assert cli.main([str(run), "--family", "qwen3_moe", "--refit-log", str(tmp_path / "none.jsonl")]) == 2


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


def test_a_moved_expert_bias_beside_the_refit_log_fails_the_run(tmp_path, capsys):
    """The trainer's expert-bias side log (X.expert_bias.jsonl beside X.refit.jsonl) is read by itself."""
    import json

    run = _write_jsonl(tmp_path / "run.jsonl", _gpu_log(1e-6, False))
    _side_log(tmp_path / "run.refit.jsonl")
    bias = tmp_path / "run.expert_bias.jsonl"
    bias.write_text("".join(json.dumps({"call": c, "rank": r, "routers": 3, "max_abs_drift": 0.0}) + "\n"
                            for c in (1, 2) for r in (0, 1)))
    assert cli.main([str(run), "--family", "qwen3_moe", "--floor", "2e-3"]) == 0
    assert "ok   [expert_bias_frozen]" in capsys.readouterr().out
    bias.write_text(bias.read_text() + json.dumps({"call": 3, "rank": 1, "routers": 3, "max_abs_drift": 1e-3}) + "\n")
    assert cli.main([str(run), "--family", "qwen3_moe", "--floor", "2e-3"]) == 1
    assert "FAIL [expert_bias_frozen] rank 1's router expert bias moved 0.001" in capsys.readouterr().out
