"""A run's identity covers the content of what it reads: a data file or a base model's config.json edited
in place (same path, same config) is refused by a resume and by a sweep's skip, both hashes named, and the
analysis refuses to pool runs of one comparison made from different bases or data."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

import fault_fixtures
from fault_fixtures import Killed, killed_run
from kill_harness import fails_with, overrides
from moerl.config import load_config
from moerl.identity import content_hash, inputs_hash, inputs_record
from moerl.trainer.checkpoint import MANIFEST, checkpoint_dirs
from moerl.trainer.warm_start import warm_start_dir

kill_at = fault_fixtures.kill_at  # the fixture, bound here so pytest finds it
ARM = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- moerl.identity ------------------------------------------------------------------------------------


def test_content_hash_is_the_sha256_of_the_bytes(tmp_path):
    data = bytes(range(256)) * 9000  # over one read chunk
    (tmp_path / "f").write_bytes(data)
    assert content_hash(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_a_model_directory_is_hashed_by_the_files_that_change_what_it_computes(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name, text in {"config.json": '{"rope_theta": 10000}', "tokenizer.json": "{}", "model.safetensors": "w1",
                       "README.md": "notes", "meta.json": "{}"}.items():
        (model / name).write_text(text)
    first = inputs_hash(model)
    assert content_hash(model) == first
    (model / "README.md").write_text("other notes")
    (model / "meta.json").write_text('{"seconds": 3}')
    assert inputs_hash(model) == first  # annotations do not change what the model computes
    for name, text in {"config.json": '{"rope_theta": 5000}', "tokenizer.json": '{"a": 1}',
                       "model.safetensors": "w2"}.items():
        before = inputs_hash(model)
        (model / name).write_text(text)
        assert inputs_hash(model) != before, name
    light = inputs_hash(model, weights=False)
    (model / "model.safetensors").write_text("w3")  # same size: not seen without weights
    assert inputs_hash(model, weights=False) == light != inputs_hash(model)


# -- resume --------------------------------------------------------------------------------------------


def _gsm8k(path: Path, answer: int = 4) -> Path:
    path.write_text("".join(json.dumps({"question": f"{i}+{answer - i}?", "answer": f"so #### {answer}"}) + "\n"
                            for i in range(16)))
    return path


def _gsm8k_args(tmp_path):
    train, test = _gsm8k(tmp_path / "train.jsonl"), _gsm8k(tmp_path / "test.jsonl")
    return ["data.task=gsm8k", f"data.train_path={train}", f"data.test_path={test}", "warm_start.enabled=false",
            *overrides(tmp_path / "runs")], train


def test_a_resume_with_a_changed_data_file_is_refused(tmp_path, kill_at):
    from moerl.trainer.grpo import GRPOTrainer

    args, train = _gsm8k_args(tmp_path)
    cfg = load_config(ARM, args)
    kill_at("step", 2)
    trainer = GRPOTrainer(cfg, cfg.run_dir, progress=False)
    with pytest.raises(Killed):
        trainer.train()
    trainer.tracker.close()
    run = cfg.run_dir
    recorded = json.loads((run / "run.json").read_text())["inputs"]
    manifest = json.loads((checkpoint_dirs(run)[-1] / MANIFEST).read_text())["inputs"]
    assert recorded == manifest and recorded["data.train_path"] == content_hash(train)
    old = recorded["data.train_path"]
    _gsm8k(train, answer=5)  # every gold answer changed, same path
    before = _files(run)
    msg = fails_with([ARM, "--resume", *args])
    assert (f"{checkpoint_dirs(run)[-1]} was made from inputs whose content changed since, cannot resume it "
            f"(data.train_path: {old} -> {content_hash(train)}; sha256 recorded -> now)") in msg, msg
    assert _files(run) == before


def test_a_resume_on_an_edited_base_config_is_refused(tmp_path, kill_at):
    cfg = killed_run(tmp_path / "runs", kill_at, "step", 2)
    run = cfg.run_dir
    recorded = json.loads((run / "run.json").read_text())["inputs"]
    assert recorded["base.config"] == content_hash(warm_start_dir(cfg) / "config.json")
    other = tmp_path / "other_cache" / warm_start_dir(cfg).name  # same weights, another rope_theta
    shutil.copytree(warm_start_dir(cfg), other)
    config = json.loads((other / "config.json").read_text())
    config["rope_theta"] = config.get("rope_theta", 10000) * 2
    (other / "config.json").write_text(json.dumps(config))
    before = _files(run)
    msg = fails_with([ARM, "--resume", *overrides(tmp_path / "runs"),
                      f"warm_start.cache_dir={tmp_path / 'other_cache'}"])
    assert (f"base.config: {recorded['base.config']} -> {content_hash(other / 'config.json')}") in msg, msg
    assert _files(run) == before


def test_a_sweep_does_not_skip_a_finished_run_whose_data_changed(tmp_path):
    from test_resume_verified import _sweep_script

    args, train = _gsm8k_args(tmp_path)
    cfg = load_config(ARM, args)
    run = cfg.run_dir
    run.mkdir(parents=True)
    from moerl.tracking import Tracker

    Tracker(run, cfg, inputs=inputs_record(cfg)).close()
    (run / "summary.json").write_text("{}")
    sweep = _sweep_script()
    overrides_only = [a for a in args]
    assert sweep.plan(Path("experiments/00_tiny_moe_cpu"), [0], ["baseline"], overrides_only, 1)[2][0].action == "skip"
    old = content_hash(train)
    _gsm8k(train, answer=5)
    with pytest.raises(SystemExit) as err:
        sweep.plan(Path("experiments/00_tiny_moe_cpu"), [0], ["baseline"], overrides_only, 1)
    assert f"cannot skip it (data.train_path: {old} -> {content_hash(train)}" in str(err.value.code)


# -- analysis ------------------------------------------------------------------------------------------


def _recorded_run(root: Path, arm: str, seed: int, base_hash: str | None, inputs: dict | None = None):
    run = root / "00_tiny_moe_cpu" / arm / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    record = {"identity": {"model.preset": "qwen3_moe", "data.task": "arith", "loss.variant": arm}}
    if base_hash is not None:
        record["base_hash"] = base_hash
    if inputs is not None:
        record["inputs"] = inputs
    (run / "run.json").write_text(json.dumps(record))


def test_the_analysis_refuses_to_pool_runs_of_other_bases_or_data(tmp_path):
    from moerl.analysis.results import MixedInputsError, load_metrics

    _recorded_run(tmp_path / "a", "baseline", 0, "aaaa")
    _recorded_run(tmp_path / "a", "baseline", 1, "bbbb")
    with pytest.raises(MixedInputsError, match=r"different base_hash \(aaaa in baseline/seed0; bbbb in "
                                               r"baseline/seed1\)"):
        load_metrics(tmp_path / "a", "00_tiny_moe_cpu")
    _recorded_run(tmp_path / "b", "baseline", 0, "aaaa", {"data.train_path": "1111"})
    _recorded_run(tmp_path / "b", "tis", 0, "aaaa", {"data.train_path": "2222"})
    with pytest.raises(MixedInputsError, match=r"different data.train_path \(1111 in baseline/seed0; 2222 in tis"):
        load_metrics(tmp_path / "b", "00_tiny_moe_cpu")
    _recorded_run(tmp_path / "c", "baseline", 0, "aaaa", {"data.train_path": "1111"})
    _recorded_run(tmp_path / "c", "baseline", 1, None)  # recorded before runs carried these hashes
    assert len(load_metrics(tmp_path / "c", "00_tiny_moe_cpu")) == 2


def test_a_sweep_does_not_skip_a_finished_run_whose_base_changed(tmp_path):
    """The cached base changed after seed 0 finished: the sweep refuses to skip it (and so to train seed 1 on
    the new base next to it), naming the base's hashes."""
    from test_resume_verified import _sweep_script

    from moerl.tracking import Tracker

    cache = tmp_path / "cache"
    args = [*overrides(tmp_path / "runs"), f"warm_start.cache_dir={cache}"]
    cfg = load_config(ARM, args)
    shutil.copytree(warm_start_dir(load_config(ARM)), warm_start_dir(cfg))
    Tracker(cfg.run_dir, cfg, inputs=inputs_record(cfg, warm_start_dir(cfg))).close()
    (cfg.run_dir / "summary.json").write_text("{}")
    sweep = _sweep_script()
    assert sweep.plan(Path("experiments/00_tiny_moe_cpu"), [0], ["baseline"], args, 1)[2][0].action == "skip"
    config = warm_start_dir(cfg) / "config.json"
    old = content_hash(config)
    config.write_text(config.read_text().replace('"norm_topk_prob": true', '"norm_topk_prob": false'))
    assert content_hash(config) != old
    with pytest.raises(SystemExit) as err:
        sweep.plan(Path("experiments/00_tiny_moe_cpu"), [0], ["baseline"], args, 1)
    assert f"cannot skip it (base.config: {old} -> {content_hash(config)}" in str(err.value.code), err.value.code
