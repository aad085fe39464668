"""Known-good upstream launch settings pass every constraint; each known-bad one is rejected by
the rule it names, with the key, the rule and the upstream source in the message."""
from pathlib import Path

import pytest
import yaml

from moerl import planner
from moerl.verl_ext import constraints, launch

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "upstream_launch"
GOOD = sorted((CORPUS / "known_good").glob("*.yaml"))
BAD = sorted((CORPUS / "known_bad").glob("*.yaml"))


def _data(path):
    return yaml.safe_load(path.read_text())


def test_corpus_is_not_empty_and_sourced():
    assert len(GOOD) >= 7 and len(BAD) >= 20
    for f in GOOD:
        d = _data(f)
        src = d.get("source") or d["moerl"]["source"]
        assert {"repo", "path", "commit"} <= set(src) and len(src["commit"]) == 40, f


@pytest.mark.parametrize("path", [p for p in GOOD if p.name.startswith("megatron_")], ids=lambda p: p.stem)
def test_known_good_megatron_recipe_passes(path):
    d = _data(path)
    spec = constraints.spec_from_megatron_recipe(d, planner.load_public_config(d["model"]))
    found = constraints.check_all(spec)
    assert [f.line() for f in found if not f.ok] == []
    assert {"megatron.transformer_config", "megatron.layer_distribution", "megatron.world_size"} <= {
        f.rule for f in found}


@pytest.mark.parametrize("path", [p for p in GOOD if p.name.startswith("verl_")], ids=lambda p: p.stem)
def test_known_good_verl_launch_dry_run_passes(path, capsys, monkeypatch):
    """verl's examples run in verl's images, which build APEX (docker/Dockerfile.stable.vllm), so
    gradient-accumulation fusion is buildable there. A rule added after the fixture was transcribed
    that refuses it names itself in ``moerl.expect_refused``; every other rule passes."""
    monkeypatch.setattr(constraints, "apex_fused_wgrad_available", lambda: True)
    refused = set(_data(path)["moerl"].get("expect_refused", []))
    rc = launch.main([str(path), "--dry-run"])
    out, err = capsys.readouterr()
    if refused:
        assert rc == 2 and {x.split("]")[0].strip().lstrip("[") for x in err.splitlines()[1:] if x.strip()} == refused
        return
    assert rc == 0, err
    assert "ok  [verl.validate_config]" in out


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_known_bad_is_rejected_by_its_rule(path):
    want = _data(path)["moerl"]["expect_rule"]
    with pytest.raises(launch.ConstraintError) as err:  # moerl.launching: judged as a launch, not a dry run
        launch.prepare(path, launching=bool(_data(path)["moerl"].get("launching")))
    line = next((x for x in str(err.value).splitlines() if x.strip().startswith(f"[{want}]")), None)
    assert line is not None, f"{want} not among:\n{err.value}"
    assert "source:" in line
    if want.startswith(("megatron.", "vllm.", "lora.", "verl.")) and want != "verl.config_dataclasses":
        assert "fix:" in line


def test_every_upstream_rule_has_a_known_bad_fixture():
    covered = {_data(p)["moerl"]["expect_rule"] for p in BAD}
    assert {name for name, _, _ in constraints.RULES} <= covered
