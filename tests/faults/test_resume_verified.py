"""A resume trusts nothing it can check: the base weights its checkpoint was trained on (by content),
the metrics rows it continues, and the names under checkpoints/; settings that would do nothing, names
that are not one path part and rows the model cannot read are refused before anything is written."""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fault_fixtures
from fault_fixtures import killed_run
from kill_harness import REPO, fails_with, overrides, run_script
from moerl.config import load_config
from moerl.trainer.checkpoint import MANIFEST, checkpoint_dirs, resumable_checkpoint, save_checkpoint
from moerl.trainer.warm_start import warm_start_dir

kill_at = fault_fixtures.kill_at  # the fixture, bound here so pytest finds it
reference_run = fault_fixtures.reference_run  # the fixture, bound here so pytest finds it

ARM = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- the base weights --------------------------------------------------------------------------------


def test_the_warm_start_cache_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    cfg = load_config(ARM, overrides(tmp_path))
    here = warm_start_dir(cfg)
    monkeypatch.chdir(tmp_path)
    assert warm_start_dir(cfg) == here == REPO / "results" / "warm_start" / here.name
    assert (here / "meta.json").exists()


def test_a_resume_on_other_base_weights_is_refused(tmp_path, kill_at):
    cfg = killed_run(tmp_path / "runs", kill_at, "step", 2)  # checkpoint step_1, then killed in step 2
    run = cfg.run_dir
    recorded = json.loads((run / "run.json").read_text())["base_hash"]
    manifest = json.loads((checkpoint_dirs(run)[-1] / MANIFEST).read_text())
    assert recorded and manifest["base_hash"] == recorded
    # The same warm start, one weight changed, in another cache directory (which is not part of the
    # config's identity: only the content can tell the two apart).
    other = tmp_path / "other_cache" / warm_start_dir(cfg).name
    shutil.copytree(warm_start_dir(cfg), other)
    weights = load_file(other / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1.0
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    before = _files(run)
    msg = fails_with([ARM, "--resume", *overrides(tmp_path / "runs"),
                      f"warm_start.cache_dir={tmp_path / 'other_cache'}"])
    assert f"{checkpoint_dirs(run)[-1]} was trained on base weights {recorded}, but this run loaded " in msg, msg
    assert f"from {other}" in msg and "restore the warm start it was trained on" in msg
    assert _files(run) == before  # nothing written


# -- the metrics log -----------------------------------------------------------------------------------


DAMAGED_LOGS = {  # how metrics.jsonl was damaged -> what the refused resume says about it
    "truncate": "no row for step 2, which checkpoint step_2 covers (steps 0..2 must each be logged once); its last "
                "line is truncated",
    "duplicate": "step 1 is logged 2 times (steps 0..2 must each be logged once)",
    "drop": "no row for step 1, which checkpoint step_2 covers",
    "delete": "no row for step 0, which checkpoint step_2 covers",
}


def test_a_resume_refuses_a_log_that_does_not_match_its_checkpoint(tmp_path, kill_at):
    cfg = killed_run(tmp_path, kill_at, "step", 3)  # checkpoints step_1, step_2; rows 0, 1, 2
    metrics = cfg.run_dir / "metrics.jsonl"
    original = metrics.read_text()
    lines = original.splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    for damage, expected in DAMAGED_LOGS.items():
        if damage == "truncate":  # a kill inside the write of step 2's row, which step_2 covers
            metrics.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
        elif damage == "duplicate":
            metrics.write_text("".join(lines[:2] + lines[1:]))
        elif damage == "drop":
            metrics.write_text("".join(lines[:1] + lines[2:]))
        else:
            metrics.unlink()
        before = _files(cfg.run_dir)
        msg = fails_with([ARM, "--resume", *overrides(tmp_path)])
        assert f"{metrics}: {expected}" in msg and "or start over with --fresh" in msg, (damage, msg)
        assert _files(cfg.run_dir) == before, damage  # nothing dropped, nothing written
        metrics.write_text(original)


# -- the checkpoints directory ---------------------------------------------------------------------------


def _save(run, step):
    weight = torch.nn.Parameter(torch.full((8,), float(step)))
    return save_checkpoint(run, step, {"w": weight}, torch.optim.AdamW([weight]), {"sampler": {}})


def test_a_stray_name_under_checkpoints_is_left_alone(tmp_path, caplog):
    cfg = load_config(ARM, overrides(tmp_path))
    _save(cfg.run_dir, 1)
    second = _save(cfg.run_dir, 2)
    stray = cfg.run_dir / "checkpoints" / "step_9.bak"
    shutil.copytree(second, stray)
    (stray / "state.json").unlink()  # not even complete: still not ours to delete
    with caplog.at_level(logging.WARNING):
        assert resumable_checkpoint(cfg.run_dir, cfg) == second
        _save(cfg.run_dir, 3)  # a save prunes and cleans up: not the user's copy
    assert f"{stray} is not a checkpoint (checkpoints are directories named step_<N>): ignored" in caplog.text
    assert stray.is_dir() and (stray / "lora.safetensors").exists()
    assert [p.name for p in checkpoint_dirs(cfg.run_dir)] == ["step_2", "step_3"]


# -- disk -------------------------------------------------------------------------------------------------


def test_a_full_disk_while_writing_token_samples_is_named(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import numpy as np

    from moerl.trainer import grpo

    def full(path, **arrays):
        Path(path).write_bytes(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(grpo, "token_samples", lambda *a, **k: {"x": np.zeros(3)})
    monkeypatch.setattr(grpo.np, "savez_compressed", full)
    cfg = load_config(ARM, overrides(tmp_path))
    trainer = SimpleNamespace(run_dir=tmp_path, cfg=cfg, step_idx=2)
    with pytest.raises(OSError) as err:
        grpo.GRPOTrainer.save_token_samples(trainer, None, SimpleNamespace(rollout_logprobs=None), None)
    assert str(err.value) == (f"[Errno 28] could not write token samples {tmp_path / 'samples' / 'step_00002.npz'} "
                              f"(No space left on device); no partial file kept; free space and continue with --resume")
    assert list((tmp_path / "samples").iterdir()) == []


# -- config --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, expected", [
    ("data.train_path=train.jsonl", "data.train_path='train.jsonl' has no effect: data.task=arith generates its rows"),
    ("data.test_path=test.jsonl", "data.test_path='test.jsonl' has no effect: data.task=arith generates its rows"),
    ("loss.icepop_alpha=0.3", "loss.icepop_alpha=0.3 has no effect: loss.variant=ppo_clip (only icepop reads it)"),
    ("loss.mis_upper=3.0", "loss.mis_upper=3.0 has no effect: loss.variant=ppo_clip (only mis reads it)"),
    ("loss.is_level=sequence", "loss.is_level='sequence' has no effect: loss.variant=ppo_clip (only tis and mis"),
    ("replay.strict=true", "replay.strict=True has no effect: replay.mode=none replays nothing to check"),
    ("replay.agreement_alarm=5.0", "replay.agreement_alarm=5.0 has no effect: replay.mode=none"),
    ("model.n_group=4", "model.n_group=4 has no effect: model.preset=qwen3_moe (only deepseek_v3 reads it)"),
])
def test_settings_that_do_nothing_are_refused(tmp_path, override, expected):
    msg = fails_with([ARM, *overrides(tmp_path / "runs"), override])
    assert expected in msg and msg.endswith("; remove it (--debug shows the traceback)"), msg
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("override, expected", [
    ("warm_start.steps=20", "warm_start.steps=20 makes the warm start's OneCycleLR warm-up end at its first step"),
    ("warm_start.steps=0", "warm_start.steps=0 is out of range: allowed [1, inf)"),
    ("model.overrides={vocab_size: 10}", "model.overrides={'vocab_size': 10}: the model cannot be built or run with it "
                                         "(IndexError: index out of range in self); fix or remove the override"),
    ("arm=../../../x", "arm='../../../x' must be a single directory name"),
    ("experiment=a/b", "experiment='a/b' must be a single directory name"),
])
def test_bad_settings_are_named_before_anything_is_written(tmp_path, override, expected):
    msg = fails_with([ARM, *overrides(tmp_path / "runs"), override])
    assert msg.startswith("config error: ") and expected in msg, msg
    assert not (tmp_path / "runs").exists() and not (tmp_path.parent / "x").exists()


# -- data -----------------------------------------------------------------------------------------------


def _gsm8k(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": "so #### 4"}) + "\n" for q in questions))
    return path


def test_a_prompt_longer_than_the_models_positions_is_refused(tmp_path):
    train = _gsm8k(tmp_path / "train.jsonl", ["2+2?", "x" * 300])
    test = _gsm8k(tmp_path / "test.jsonl", ["1+3?"])
    msg = fails_with([ARM, "data.task=gsm8k", f"data.train_path={train}", f"data.test_path={test}",
                      *overrides(tmp_path / "runs")])
    assert f"data.train_path={train}: row 1: its prompt is " in msg
    assert "with rollout.max_new_tokens=8 exceeds the model's 256 positions; drop or shorten the row" in msg
    assert not (tmp_path / "runs").exists()


def test_characters_the_tokenizer_does_not_know_are_named(tmp_path, caplog):
    from moerl.data import load_splits
    from moerl.data.checks import check_rows

    train = _gsm8k(tmp_path / "train.jsonl", ["2+2?", "Zoë has 2 apples and 2 more?", "3+1?"])
    test = _gsm8k(tmp_path / "test.jsonl", ["1+3?"])
    cfg = load_config(ARM, ["data.task=gsm8k", f"data.train_path={train}", f"data.test_path={test}"])
    with caplog.at_level(logging.WARNING):
        check_rows(cfg, *load_splits(cfg.data), max_positions=256)
    assert (f"data.train_path={train}: 1 of 3 rows hold characters the tokenizer does not know (first: row 1, 'ë'): "
            f"the model reads each as <unk>") in caplog.text
    assert "data.test_path" not in caplog.text


# -- scripts ----------------------------------------------------------------------------------------------


def _sweep_script():
    import sys

    from tests_helpers import load_script

    if "moerl_sweep_script" not in sys.modules:  # one copy: dataclasses look their module up by name
        load_script("scripts/sweep.py", "moerl_sweep_script")
    return sys.modules["moerl_sweep_script"]


def test_a_stale_sweep_plan_does_not_move_a_finished_run_aside(reference_run, capsys):
    out = reference_run.parents[2]
    before = _files(reference_run)
    siblings = sorted(p.name for p in reference_run.parent.iterdir())
    summary = run_script.main([ARM, "--fresh", "--unless-started", *overrides(out)])
    assert summary["steps"] == 4
    assert (f"{reference_run} was finished by another process after this run was planned: nothing to do, nothing "
            f"moved aside") in capsys.readouterr().out
    assert _files(reference_run) == before and sorted(p.name for p in reference_run.parent.iterdir()) == siblings
    sweep = _sweep_script()
    assert sweep.build_command("py", "c.yaml", 0, "fresh", 1, [], "run.py")[5:7] == ["--fresh", "--unless-started"]


def test_a_corrupt_sweep_record_stops_the_sweep_before_its_runs(tmp_path):
    sweep = _sweep_script()
    record = tmp_path / "00_tiny_moe_cpu" / "sweep.json"
    record.parent.mkdir()
    record.write_text('{"invocations": [')
    never = tmp_path / "never_run.py"
    never.write_text("raise SystemExit('a run was started')\n")
    with pytest.raises(SystemExit) as err:
        sweep.main(["experiments/00_tiny_moe_cpu", "--arms", "baseline", "--seeds", "1", "--output-dir",
                    str(tmp_path), "--run-script", str(never), "warm_start.enabled=false"])
    assert str(err.value.code).startswith(f"{record}: not a readable sweep record (")
    assert "move it aside (the runs' own directories hold their results) and run the sweep again" in str(err.value.code)
    assert sorted(p.name for p in record.parent.iterdir()) == ["sweep.json"]
    assert record.read_text() == '{"invocations": ['


def test_the_dose_report_names_a_run_it_cannot_read(tmp_path):
    from moerl.analysis.dose import RunReadError, load_runs

    run = tmp_path / "07_dose_threshold" / "baseline" / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RunReadError, match=f"^{run / 'config.yaml'}: missing .*; restore it, or move {run} out of"):
        load_runs(tmp_path)
    shutil.copy(REPO / "tests/fixtures/runs_07/07_dose_threshold/fp32_control/seed0/config.yaml", run / "config.yaml")
    (run / "metrics.jsonl").write_text('{"step": 0}\ngarbage\n{"step": 1}\n')
    with pytest.raises(RunReadError, match=f"^{run / 'metrics.jsonl'}: line 2 is not valid JSON; restore it"):
        load_runs(tmp_path)
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(REPO / "experiments/07_dose_threshold/report.py"), "--runs",
                           str(tmp_path), "--out", str(tmp_path / "out"), "--results", ""], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")}, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip() == f"report: {run / 'metrics.jsonl'}: line 2 is not valid JSON; restore it, or move " \
                                  f"{run} out of {tmp_path}"
