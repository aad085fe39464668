from pathlib import Path

import pytest

from moerl.config import load_config

ARMS = Path(__file__).resolve().parents[2] / "experiments" / "00_tiny_moe_cpu" / "arms"


@pytest.mark.parametrize("arm, mode, preset", [("r2", "R2", "qwen3_moe"), ("r3", "R3", "qwen3_moe"),
                                               ("deepseek_r3", "R3", "deepseek_v3")])
def test_replay_arms_load(arm, mode, preset):
    cfg = load_config(ARMS / f"{arm}.yaml")
    assert (cfg.arm, cfg.replay.mode, cfg.model.preset) == (arm, mode, preset)
    assert cfg.replay.mode != "R3" or cfg.rollout.capture_routing  # R3 replays the engine's capture


def test_position_mapping_is_only_an_r3_bug_reproduction():
    from moerl.config import ConfigError

    cfg = load_config(ARMS / "deepseek_r3.yaml", ["replay.layer_mapping=position"])
    assert cfg.replay.layer_mapping == "position"
    assert load_config(ARMS / "deepseek_r3.yaml").replay.layer_mapping == "layer_number"  # the default
    with pytest.raises(ConfigError, match="replay.layer_mapping=position reproduces an R3 bug"):
        load_config(ARMS / "r2.yaml", ["replay.layer_mapping=position"])
