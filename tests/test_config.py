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
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        load_config(None, ["rollout.group_size=1"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_override_parsing():
    assert parse_override("trainer.lr=0.5") == {"trainer": {"lr": 0.5}}
    assert parse_override("loss.dual_clip_c=null") == {"loss": {"dual_clip_c": None}}
    cfg = load_config(None, ["trainer.lr=3e-4", "seed=3"])
    assert isinstance(cfg, ExperimentConfig) and cfg.trainer.lr == 3e-4 and cfg.seed == 3
