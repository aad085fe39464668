"""Bad input of every class: one line naming the file / key / sample and what was expected,
before anything is written."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from kill_harness import REPO as REPO_ROOT, fails_with
from moerl.config import ConfigError, load_config

ARM = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"


def test_config_errors_name_the_layer(tmp_path):
    base, arm = tmp_path / "base.yaml", tmp_path / "arm.yaml"
    base.write_text("experiment: x\ntrainer:\n  stpes: 3\n")
    arm.write_text("base: base.yaml\narm: a\n")
    with pytest.raises(ConfigError, match=rf"^{base}: unknown config key 'trainer.stpes' \(did you mean 'steps'\?\)"):
        load_config(arm)
    base.write_text("experiment: x\n")
    arm.write_text("base: base.yaml\nrollout:\n  top_p: 1.5\n")
    with pytest.raises(ConfigError, match=rf"^{arm}: rollout.top_p=1.5 is out of range: allowed \(0, 1\]"):
        load_config(arm)
    arm.write_text("base: base.yaml\n")
    msg = fails_with([str(arm), "trainer.stpes=3", f"tracking.output_dir={tmp_path / 'runs'}"])
    assert "command-line override 'trainer.stpes=3': unknown config key 'trainer.stpes'" in msg
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("override, allowed", [
    ("trainer.mini_batches=0", "[1, inf)"), ("trainer.mini_batches=-2", "[1, inf)"), ("model.top_k=-1", "[1, inf)"),
    ("model.top_k=0", "[1, inf)"), ("trainer.lr=-1", "(0, inf)"), ("trainer.lr=nan", "(0, inf)"),
    ("trainer.steps=-5", "[1, inf)"), ("rollout.prompts_per_step=0", "[1, inf)"),
    ("rollout.max_new_tokens=0", "[1, inf)"), ("trainer.epochs=0", "[1, inf)"), ("trainer.grad_clip=-1", "(0, inf)"),
    ("threads=0", "[1, inf)"), ("model.num_layers=0", "[1, inf)"), ("trainer.checkpoint_every=-1", "[0, inf)"),
    ("trainer.eval_every=-1", "[0, inf)"), ("trainer.warmup_steps=-3", "[0, inf)"),
    ("trainer.betas=[0.9,1.5]", "[0, 1)"), ("loss.tis_cap=inf", "(0, inf)"),
])
def test_out_of_range_values_are_named(tmp_path, override, allowed):
    key = override.split("=")[0]
    msg = fails_with([ARM, override, f"tracking.output_dir={tmp_path}"])
    assert msg.startswith(f"config error: command-line override '{override}': {key}=") and \
        f"is out of range: allowed {allowed}" in msg, msg
    assert not any(tmp_path.iterdir())


def _gsm(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dataset_errors_before_anything_is_written(tmp_path, caplog):
    good = [{"question": f"{i}+1?", "answer": f"so\n#### {i + 1}"} for i in range(4)]
    test = _gsm(tmp_path / "test.jsonl", good)
    out = tmp_path / "runs"

    def run(train, test_path=test):
        extra = [f"data.test_path={test_path}"] if test_path else []
        return fails_with([ARM, "data.task=gsm8k", f"data.train_path={train}", *extra, "warm_start.enabled=false",
                           "data.train_size=4", "data.test_size=4", f"tracking.output_dir={out}"])

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert f"{empty}: empty file (expected one JSON object per line" in run(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(good[0]) + "\n{'question': 'single quotes'}\n")
    assert f"{broken}: line 2 is not valid JSON" in run(broken)
    unusable = _gsm(tmp_path / "unusable.jsonl", [{"question": "q"}, {"answer": "#### 3"}])
    assert f"{unusable}: no usable training rows" in run(unusable)
    assert "data.task=gsm8k: no test rows to evaluate on (set data.test_path" in run(test, test_path=None)
    assert not out.exists()

    from moerl.data import load_local

    words = _gsm(tmp_path / "words.jsonl", good[:2] + [{"question": "q", "answer": "#### twelve"}])
    with caplog.at_level(logging.WARNING):
        rows = load_local(words, "gsm8k")
    assert len(rows) == 2
    assert f"{words}: line 3: gold answer 'twelve' is not a number (expected '#### <number>'); skipped" in caplog.text


def test_trace_errors_name_the_batch_sample():
    from moerl.replay.trace import RoutingTrace, TraceError

    n, t = 256, 6
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(n * t * 2)]).view(n, t, 2, 2).to(torch.uint8)
    trace = RoutingTrace(idx, torch.ones(n, t, dtype=torch.bool), (1, 3), 8, 2)
    trace.indices[200, 3, 1, 0] = 9  # corrupted after the batch was checked: found when a micro-batch is cut
    with pytest.raises(TraceError, match=r"^sample 200, token 3, layer 3: expert id 9 out of range \[0, 8\)"):
        trace[128:256]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    mini = order[(order == 200).nonzero()[0, 0] // 64 * 64:][:64]  # the shuffled micro-batch holding 200
    with pytest.raises(TraceError, match=r"^sample 200, token 3"):
        trace[mini].truncate_tokens(t - 1)


def test_replay_violation_names_the_batch_sample():
    """A strict replay that finds other experts than the trace's names the sample of the batch."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "replay"))
    from replay_helpers import random_ids, random_trace, small_model
    from moerl.models.routers import find_moe_layers
    from moerl.replay.diagnostics import ReplayViolation
    from moerl.replay.session import routing_session

    model = small_model("qwen3_moe")
    layers = find_moe_layers(model)
    numbers = tuple(x.layer_number for x in layers)
    batch = random_trace(256, 6, numbers, layers[0].num_experts, layers[0].top_k, seed=1,
                         valid=torch.ones(256, 6, dtype=torch.bool))
    rows = torch.tensor([31, 200, 7, 64])  # a shuffled micro-batch; sample 200 sits at position 1
    ids = random_ids(4, 6)

    def foreign(module, args):  # another hook rewrites the experts of position 1 after the replay chose them
        index = args[1].clone().view(4, 6, -1)
        index[1] = (index[1] + 1) % layers[0].num_experts
        return (args[0], index.view(args[1].shape), *args[2:])

    with pytest.raises(ReplayViolation, match=rf"^layer {numbers[0]}, sample 200, token 0: experts received"):
        with torch.no_grad(), routing_session(model, ids.shape, replay=batch[rows], strict=True):
            # registered after the session's hooks, so it sees (and changes) what the replay passed on
            hooks = [x.block.experts.register_forward_pre_hook(foreign) for x in layers]
            try:
                model(ids)
            finally:
                for h in hooks:
                    h.remove()


@pytest.mark.parametrize("overrides, expected", [
    (["model.num_heads=3"], "command-line override 'model.num_heads=3': model.num_heads=3 must be a multiple of "
                            "model.num_kv_heads=2"),
    (["model.head_dim=31"], "command-line override 'model.head_dim=31': model.head_dim=31 must be even"),
    (["model.hidden_size=100"], "command-line override 'model.hidden_size=100': model.hidden_size=100 and "
                                "model.moe_intermediate_size=128 must be multiples of 8"),
    (["model.preset=deepseek_v3", "model.head_dim=30"], "command-line override 'model.head_dim=30': "
                                                        "model.head_dim=30 must be a multiple of 4"),
    (["model.preset=deepseek_v3", "model.num_experts=2"],
     "command-line override 'model.num_experts=2': model.num_experts=2 / model.n_group=2 must leave at least 2 experts"),
], ids=["heads", "head_dim", "grouped_mm", "mla_head_dim", "experts_per_group"])
def test_model_shapes_are_checked_before_anything_is_written(tmp_path, overrides, expected):
    msg = fails_with([ARM, *overrides, "warm_start.enabled=false", f"tracking.output_dir={tmp_path}"])
    assert msg.startswith(f"config error: {expected}"), msg
    assert not any(tmp_path.iterdir())


def test_a_data_file_that_is_not_utf8_names_file_line_and_split(tmp_path):
    good = [{"question": f"{i}+1?", "answer": f"so\n#### {i + 1}"} for i in range(4)]
    test = _gsm(tmp_path / "test.jsonl", good)
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(test.read_bytes() + '{"question": "caf\u00e9?", "answer": "#### 1"}\n'.encode("latin-1"))
    out = tmp_path / "runs"
    msg = fails_with([ARM, "data.task=gsm8k", f"data.train_path={test}", f"data.test_path={latin}",
                      "warm_start.enabled=false", f"tracking.output_dir={out}"])
    assert msg == (f"error: data.test_path: {latin}: line 5 is not UTF-8 text (byte 0xe9 at column 18); "
                   f"expected one UTF-8 JSON object per line (--debug shows the traceback)"), msg
    assert not out.exists()


def test_a_bad_yaml_value_in_an_override_names_the_override(tmp_path):
    msg = fails_with([ARM, "trainer.lr=[1", f"tracking.output_dir={tmp_path}"])
    assert msg.startswith("config error: command-line override 'trainer.lr=[1': the value is not valid YAML ("), msg
    assert not any(tmp_path.iterdir())


def test_cross_key_errors_name_the_layer_that_set_the_value(tmp_path):
    from kill_harness import REPO

    base = REPO / "experiments" / "00_tiny_moe_cpu" / "base.yaml"
    arm = tmp_path / "arm.yaml"
    arm.write_text(f"base: {base}\narm: a\n")
    rule = r"rollout.prompts_per_step \* rollout.group_size must be divisible by trainer.mini_batches"
    with pytest.raises(ConfigError, match=rf"^command-line override 'trainer.mini_batches=5': {rule}"):
        load_config(arm, ["trainer.mini_batches=5"])
    arm.write_text(f"base: {base}\narm: a\ntrainer:\n  mini_batches: 5\n")
    with pytest.raises(ConfigError, match=rf"^{arm}: {rule}"):
        load_config(arm, ["trainer.lr=0.001"])


def test_an_empty_arm_file_and_duplicate_keys_are_refused(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=rf"^{empty}: empty config file \(expected a mapping"):
        load_config(empty)
    twice = tmp_path / "twice.yaml"
    twice.write_text("trainer:\n  lr: 0.001\n  steps: 3\n  lr: 0.01\n")
    with pytest.raises(ConfigError, match=rf"^{twice}: key 'lr' appears twice \(lines 2 and 4\); keep one"):
        load_config(twice)


def test_yaml_merge_keys_work_and_a_key_of_its_own_overrides_a_merged_one(tmp_path):
    base = (REPO_ROOT / "experiments" / "00_tiny_moe_cpu" / "base.yaml").resolve()
    arm = tmp_path / "arm.yaml"
    arm.write_text(f"base: {base}\narm: merged\ntrainer:\n  <<: {{lr: 0.001, steps: 3}}\n  steps: 5\n"
                   f"rollout: &r\n  group_size: 4\n")
    cfg = load_config(arm)
    assert (cfg.trainer.lr, cfg.trainer.steps, cfg.rollout.group_size) == (0.001, 5, 4)
    arm.write_text(f"base: {base}\ntrainer:\n  <<: {{lr: 0.001}}\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"key 'steps' appears twice \(lines 4 and 5\)"):
        load_config(arm)


def test_an_escaping_arm_names_where_arm_was_set(tmp_path):
    with pytest.raises(ConfigError, match=r"^command-line override 'arm=\.\./\.\./x': arm='\.\./\.\./x' must be"):
        load_config(ARM, ["arm=../../x"])
    arm = tmp_path / "arm.yaml"
    arm.write_text(f"base: {(REPO_ROOT / ARM).resolve()}\narm: ../../x\n")
    with pytest.raises(ConfigError, match=rf"^{arm}: arm='\.\./\.\./x' must be"):
        load_config(arm, ["trainer.lr=0.001"])


def test_sizes_the_machine_cannot_hold_are_refused_before_anything_is_written(tmp_path):
    from moerl.sizes import size_checks

    msg = fails_with([ARM, "rollout.prompts_per_step=100000000000000000000", "trainer.mini_batches=1",
                      f"tracking.output_dir={tmp_path / 'runs'}"])
    assert msg.startswith("config error: command-line override 'rollout.prompts_per_step=100000000000000000000': "
                          "rollout.prompts_per_step=100000000000000000000 x rollout.group_size=8 = "), msg
    assert "GiB of memory; lower rollout.prompts_per_step" in msg, msg
    assert not (tmp_path / "runs").exists()
    cfg = load_config(ARM)  # the committed sizes fit a small machine
    assert all(ok for ok, _ in size_checks(cfg, memory=2 << 30))
    cfg.data.train_size = 100_000_000
    refused = [m for ok, m in size_checks(cfg, memory=2 << 30) if not ok]
    assert len(refused) == 1 and refused[0].startswith("data.train_size=100000000 + data.test_size=512 rows take at "
                                                       "least 9.31 GiB, more than this machine's 2.0 GiB"), refused


def test_a_refused_resume_from_another_working_directory_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = fails_with([str(REPO_ROOT / ARM), "--resume", "tracking.output_dir=runs", "warm_start.enabled=false"])
    assert "no such run to resume" in msg and "tracking.output_dir=runs is relative, taken from the working " \
                                              f"directory {tmp_path}" in msg, msg
    assert list(tmp_path.iterdir()) == []  # no empty folders, no lock file
