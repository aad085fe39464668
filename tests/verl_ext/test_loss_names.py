"""docs/losses.md's table of moerl's loss settings as verl's keys: every verl key, preset and value it
names is verl 0.9.1's own."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

pytest.importorskip("verl")
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def table_rows() -> list[list[str]]:
    text = (REPO / "docs" / "losses.md").read_text()
    section = text[text.index("## The same settings in verl and TRL"):text.index("## verl (scale path)")]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]  # the header row dropped


def pairs(cell: str) -> list[tuple[str, str]]:
    """`key: value` pairs of a cell (`actor.x` keys without a value give an empty value)."""
    out = []
    for code in re.findall(r"`([^`]+)`", cell):
        key, _, value = code.partition(":")
        out.append((key.strip(), value.strip().strip('"')))
    return out


def test_the_table_covers_every_variant():
    from moerl.verl_ext.losses import VARIANTS

    first = " ".join(row[0] for row in table_rows())
    assert all(f"`{v}" in first for v in VARIANTS)


def test_presets_set_what_the_table_says():
    for moerl, preset, keys, _, _ in table_rows():
        if preset == "—":
            continue
        name = preset.strip("`")
        config = getattr(RolloutCorrectionConfig, name)()  # a preset with its defaults
        for key, value in pairs(keys):
            assert hasattr(config, key), f"{moerl}: {key} is not a RolloutCorrectionConfig field"
            literal = value if value not in ("", "C", "hi", "lo_hi", "α_β") else None  # placeholders aside
            if literal is not None:
                assert str(getattr(config, key)).lower() == literal.lower().replace("null", "none"), (moerl, key)


def test_every_verl_key_exists():
    import yaml
    import verl

    actor = yaml.safe_load((Path(verl.__file__).parent / "trainer" / "config" / "actor" / "actor.yaml").read_text())
    fields = {f.name for f in dataclasses.fields(RolloutCorrectionConfig)}
    for moerl, _, keys, _, _ in table_rows():
        for code in re.findall(r"`([^`]+)`", keys):
            key = code.split(":")[0].strip()
            if key.startswith("actor."):
                node = actor
                for part in key.removeprefix("actor.").split("/")[0].split("."):
                    assert isinstance(node, dict) and part in node, f"{moerl}: actor key {key} not in verl's actor.yaml"
                    node = node[part]
            elif re.fullmatch(r"[a-z_]+", key):
                assert key in fields, f"{moerl}: {key} is not a RolloutCorrectionConfig field"


def test_aggregation_names_match_the_plug_in():
    from moerl.verl_ext.losses import AGG_TO_VERL

    row = next(r for r in table_rows() if r[0].startswith("`aggregation`"))
    moerl = re.findall(r"`([a-z_]+)`", row[0])[1:]
    verl = re.findall(r"`([a-z-]+)`", row[2].split(":", 1)[1])
    assert dict(zip(moerl, verl)) == AGG_TO_VERL
