import re
from pathlib import Path

import pytest

from moerl.config import ConfigError, ExperimentConfig, load_config, parse_override

ARMS = sorted(Path("experiments/00_tiny_moe_cpu/arms").glob("*.yaml"))


@pytest.mark.parametrize("arm", ARMS, ids=[a.stem for a in ARMS])
def test_every_arm_loads_and_names_itself(arm):
    cfg = load_config(arm)
    assert cfg.arm == arm.stem
    assert cfg.experiment == "00_tiny_moe_cpu"


def test_arm_inherits_base_and_overrides():
    base = load_config("experiments/00_tiny_moe_cpu/base.yaml")
    fp32 = load_config("experiments/00_tiny_moe_cpu/arms/fp32_rollout.yaml")
    assert base.rollout.dtype == "bf16" and fp32.rollout.dtype == "fp32"
    assert fp32.model == base.model


def test_misspelt_key_names_the_closest(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"trainer\.learning_rate.*did you mean"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"rolout.*did you mean 'rollout'"):
        load_config(None, ["rolout.dtype=fp32"])


def test_wrong_types_and_literals_are_rejected():
    with pytest.raises(ConfigError, match="rollout.dtype.*not one of"):
        load_config(None, ["rollout.dtype=fp4"])
    with pytest.raises(ConfigError, match="trainer.steps: expected an integer"):
        load_config(None, ["trainer.steps=ten"])
    with pytest.raises(ConfigError, match=r"rollout.group_size=1 is out of range: allowed \[2, inf\)"):
        load_config(None, ["rollout.group_size=1"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_override_parsing():
    assert parse_override("trainer.lr=0.5") == {"trainer": {"lr": 0.5}}
    assert parse_override("loss.dual_clip_c=null") == {"loss": {"dual_clip_c": None}}
    cfg = load_config(None, ["trainer.lr=3e-4", "seed=3"])
    assert isinstance(cfg, ExperimentConfig) and cfg.trainer.lr == 3e-4 and cfg.seed == 3


def test_every_numeric_field_declares_its_range():
    from moerl.config import numeric_fields

    fields = numeric_fields()
    assert len(fields) > 50
    missing = [key for key, f in fields if "range" not in f.metadata]
    assert not missing, f"numeric config fields without a declared range (use num(...)): {missing}"


def test_omegaconf_merging_and_dotlist_overrides():
    cfg = load_config("experiments/00_tiny_moe_cpu/arms/r3.yaml",
                      ["trainer.eval_every=${trainer.checkpoint_every}", "trainer.betas=[0.8,0.9]"])
    assert cfg.trainer.eval_every == cfg.trainer.checkpoint_every == 10 and cfg.trainer.betas == (0.8, 0.9)
    assert cfg.replay.mode == "R3" and cfg.rollout.dtype == "bf16"  # arm over base


def test_threads_default_to_the_usable_cores(monkeypatch):
    import os

    from moerl.config import resolved_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml")
    assert cfg.threads is None and resolved_threads(cfg) == len(os.sched_getaffinity(0))
    assert resolved_threads(load_config(None, ["threads=3"])) == 3


def test_threads_null_honours_omp_num_threads(monkeypatch):
    from moerl.config import resolved_threads

    cfg = load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert resolved_threads(cfg) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3,1")  # OpenMP's nested form: the outer level
    assert resolved_threads(cfg) == 3
    assert resolved_threads(load_config(None, ["threads=2"])) == 2  # an explicit setting wins
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS='many'"):
        resolved_threads(cfg)


@pytest.mark.parametrize("overrides, named", [
    (["model.first_k_dense=4"], "model.first_k_dense=4 leaves no MoE layer among model.num_layers=4"),
    (["model.overrides.first_k_dense_replace=4"], "first_k_dense_replace"),
])
def test_config_with_no_moe_layer_is_refused(overrides, named, tmp_path):
    arm = "experiments/00_tiny_moe_cpu/arms/deepseek_r3.yaml"
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(arm, [f"tracking.output_dir={tmp_path}", *overrides])
    assert list(tmp_path.iterdir()) == []  # refused before anything is written


def test_qwen3_with_only_dense_layers_is_refused():
    with pytest.raises(ConfigError, match=r"model.overrides=\{'mlp_only_layers': \[0, 1, 2, 3\]\} leave no MoE layer"):
        load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml", ["model.overrides.mlp_only_layers=[0,1,2,3]"])
    # three dense layers of four still leave one MoE layer
    load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml", ["model.overrides.mlp_only_layers=[0,1,2]"])


def test_run_identity_and_name():
    from moerl.config import config_diff, config_hash, identity_dict

    plain = load_config("experiments/00_tiny_moe_cpu/arms/tis.yaml")
    same = load_config("experiments/00_tiny_moe_cpu/arms/tis.yaml", ["threads=1", "tracking.output_dir=elsewhere"])
    other = load_config("experiments/00_tiny_moe_cpu/arms/tis.yaml", ["loss.tis_cap=3.0"])
    assert config_hash(plain) == config_hash(same) and same.run_name == "00_tiny_moe_cpu/tis/seed0"
    assert config_hash(other) != config_hash(plain) and other.run_name == "00_tiny_moe_cpu/tis+loss.tis_cap-3.0/seed0"
    assert config_diff(identity_dict(plain), identity_dict(other)) == ["loss.tis_cap: 2.0 -> 3.0"]
    many = load_config(None, [f"model.hidden_size={64 + 8 * i}" for i in range(8)])
    assert len(many.variant) < 40 and many.variant.startswith("8overrides-")


def test_run_directory_names_take_no_quoting_and_old_names_are_still_found(tmp_path):
    from moerl.analysis.results import load_run

    arm = "experiments/07_dose_threshold/arms/tis.yaml"
    overrides = ["rollout.dtype=nvfp4", "loss.eps_low=0.1", "model.overrides.mlp_only_layers=[0,1]",
                 f"tracking.output_dir={tmp_path}"]
    cfg = load_config(arm, overrides)
    name = cfg.run_dir.parent.name
    assert name == "tis+rollout.dtype-nvfp4+loss.eps_low-0.1+model.overrides.mlp_only_layers-_0_1_"
    assert re.fullmatch(r"[A-Za-z0-9._+-]+", name)  # no '=', ',', brackets: a shell and a glob take it as it is
    # a run recorded under the older name is the run of this config: found, so skipped or resumed, not redone
    old = tmp_path / "07_dose_threshold" / "tis+rollout.dtype=nvfp4" / "seed0"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    assert load_config(arm, ["rollout.dtype=nvfp4", f"tracking.output_dir={tmp_path}"]).run_dir == old
    for spelling in ("tis+rollout.dtype-nvfp4", "tis+rollout.dtype=nvfp4"):
        assert load_run(tmp_path, "07_dose_threshold", spelling, 0)["reward/mean"].tolist() == [0.5]
    # once a run exists under the new name, that one is used
    new = tmp_path / "07_dose_threshold" / "tis+rollout.dtype-nvfp4" / "seed0"
    new.mkdir(parents=True)
    assert load_config(arm, ["rollout.dtype=nvfp4", f"tracking.output_dir={tmp_path}"]).run_dir == new
