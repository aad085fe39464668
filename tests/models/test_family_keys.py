"""Every model key a family does not read is refused when set, for each preset; a key at its default (what
a recorded run's config.yaml holds for every key) is not; ``--print-config`` shows only the family's keys."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from moerl.config import ConfigError, ModelConfig, config_yaml, load_config
from moerl.models.family_keys import FAMILY_KEYS, unread_keys
from moerl.models.presets import PRESETS

ARM = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"
FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]
# a legal value other than the default, for each key some family does not read
OTHER_VALUE = {"first_k_dense": 3, "n_shared_experts": 2, "n_group": 4, "topk_group": 2, "num_kv_heads": 4}


def test_the_table_covers_every_preset_and_key():
    assert set(FAMILY_KEYS) == set(PRESETS)
    for preset, keys in FAMILY_KEYS.items():
        assert keys <= set(FIELDS), (preset, keys - set(FIELDS))
    # every key is read by some family, but those that say where the model comes from (the config's own rules)
    assert set(FIELDS) - set().union(*FAMILY_KEYS.values()) == {"path", "trust_remote_code"}
    assert set(OTHER_VALUE) == {k for p in PRESETS for k in unread_keys(p, FIELDS)}


CASES = [(preset, key) for preset in PRESETS for key in unread_keys(preset, FIELDS)]


@pytest.mark.parametrize("preset, key", CASES)
def test_a_key_the_preset_does_not_read_is_refused(preset, key):
    with pytest.raises(ConfigError) as err:
        load_config(ARM, [f"model.preset={preset}", f"model.{key}={OTHER_VALUE[key]}"])
    message = str(err.value)
    assert f"model.{key}={OTHER_VALUE[key]} has no effect: " in message and "\n" not in message, message
    assert message.startswith(f"command-line override 'model.{key}={OTHER_VALUE[key]}'"), message


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_loads_with_every_key_at_its_default_and_prints_only_its_keys(preset):
    cfg = load_config(ARM, [f"model.preset={preset}", "model.num_kv_heads=2"])  # 2: the default
    shown = yaml.safe_load(config_yaml(cfg, only_read=True))["model"]
    assert set(shown) == FAMILY_KEYS[preset]  # a preset run reads no checkpoint key (model.path, trust_remote_code)
    assert set(yaml.safe_load(config_yaml(cfg))["model"]) == set(FIELDS)  # a run records every key


def test_print_config_shows_only_the_keys_of_the_family(capsys):
    from tests_helpers import load_script

    run = load_script("scripts/run.py", "moerl_run_script_family_keys")
    run.main([ARM, "--print-config"])
    printed = yaml.safe_load(capsys.readouterr().out)["model"]
    assert "first_k_dense" not in printed and "n_group" not in printed and printed["preset"] == "qwen3_moe"
