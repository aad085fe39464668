"""A relaunch verifies what verl would resume: the same run (moerl_run.json), a complete step, one writer.

verl's ``main_ppo`` is replaced by a stand-in that saves the way verl 0.9.1's ``_save_checkpoint``
does for a LoRA Megatron actor; the run's checkpoint root, logs and base model are temporary folders."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from moerl import runlock
from moerl.verl_ext import launch, resume_check

EXP = Path(__file__).resolve().parents[2] / "experiments" / "04_moonlight_16b_a3b_r3"
RUNG = [str(EXP), "--rung", "1", "--seed", "0"]
TRACKER = "latest_checkpointed_iteration.txt"
# verl 0.9.1 trainer_base.py _save_checkpoint: the actor's Megatron-Core dist checkpoints (model = the
# PEFT adapter shards, optimizer, extra = RNG states; metadata.json is the last file each one gets),
# then data.pt, then the tracker
STEP_FILES = ("actor/model/dist_ckpt/.metadata", "actor/model/dist_ckpt/__0_0.distcp",
              "actor/model/dist_ckpt/metadata.json", "actor/optimizer/dist_ckpt/__0_0.distcp",
              "actor/optimizer/dist_ckpt/metadata.json", "actor/extra/dist_ckpt/metadata.json", "data.pt")


def verl_save(run_dir: Path, step: int, skip=(), tracker=True) -> Path:
    d = run_dir / f"global_step_{step}"
    for rel in STEP_FILES:
        if rel not in skip:
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(b"x")
    if tracker:
        (run_dir / TRACKER).write_text(str(step))
    return d


@pytest.fixture
def run(tmp_path, monkeypatch):
    """Rung 1 of experiment 04, seed 0, with its base model, checkpoints and logs under tmp_path, and a
    stand-in main_ppo that checks it runs under the run's lock and saves step 5."""
    model = tmp_path / "models" / "tiny_moonlight"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "deepseek_v3", "hidden_size": 64}')
    (model / "model.safetensors.index.json").write_text('{"weight_map": {"w": "model-00001-of-00001.safetensors"}}')
    (model / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    monkeypatch.setenv("MOERL_CKPT", str(tmp_path / "models"))
    monkeypatch.setenv("MOERL_REPO", str(tmp_path))
    monkeypatch.setenv("MOERL_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    # a launch needs its data where it starts (rule paths.exist_where_the_job_runs)
    monkeypatch.setenv("MOERL_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "data" / "math").mkdir(parents=True)
    for split in ("train", "test"):
        (tmp_path / "data" / "math" / f"{split}.parquet").write_bytes(b"")
    run_dir = tmp_path / "ckpt" / "moerl" / "04_rung1_seed0"
    calls = []

    def main_ppo(cmd, env, cwd, pass_fds=()):
        assert runlock.lock_holder(run_dir) == str(os.getpid())  # held while verl runs
        assert set(pass_fds) == set(runlock.held_fds(run_dir)) and pass_fds  # and by verl itself
        calls.append(cmd)
        verl_save(run_dir, 5)
        return 0

    monkeypatch.setattr(launch.subprocess, "call", main_ppo)
    return {"dir": run_dir, "model": model, "calls": calls, "root": tmp_path}


def _files(root: Path) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_first_launch_records_the_run_and_an_identical_relaunch_resumes_it(run, capsys):
    assert launch.main(RUNG) == 0
    manifest = json.loads((run["dir"] / "moerl_run.json").read_text())
    ident = manifest["identity"]
    assert ident["actor_rollout_ref.model.lora.rank"] == 32 and ident["moerl.seed"] == 0
    assert ident["actor_rollout_ref.actor.megatron.router_replay.mode"] == "R3"
    assert ident["base_model.weights"].startswith("1 safetensors files, 64 bytes")
    assert manifest["launches"][0]["resumes"] is None and "git_commit" in manifest["launches"][0]
    assert "starts from scratch; recorded this run in moerl_run.json" in capsys.readouterr().out

    verl_save(run["dir"], 10, skip=("data.pt",), tracker=False)  # a save cut short by the job's end
    before = _files(run["root"])
    assert launch.main(RUNG + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert _files(run["root"]) == before  # a dry run writes nothing
    assert f"# checkpoints: {run['dir']}: resumes global_step_5, complete; same run as moerl_run.json" in out
    assert f"# left alone: global_step_10 in {run['dir']}, newer than {TRACKER}'s step 5 (a save cut short)" in out

    assert launch.main(RUNG) == 0 and len(run["calls"]) == 2
    launches = json.loads((run["dir"] / "moerl_run.json").read_text())["launches"]
    assert [entry["resumes"] for entry in launches] == [None, str(run["dir"] / "global_step_5")]


def test_a_relaunch_that_changed_the_run_is_refused_in_one_line_and_writes_nothing(run, capsys):
    assert launch.main(RUNG) == 0
    capsys.readouterr()
    config, shard = run["model"] / "config.json", run["model"] / "model-00001-of-00001.safetensors"
    changes = [  # (command line, file to change, key, recorded and new value as the line writes them: JSON)
        (["actor_rollout_ref.model.lora.rank=16"], None, "actor_rollout_ref.model.lora.rank", "32", "16;"),
        ([], (config, b'{"model_type": "deepseek_v3", "hidden_size": 128}'), "base_model.config_json",
         '"sha256 ', '"sha256 '),
        ([], (shard, b"\0" * 65), "base_model.weights", '"1 safetensors files, 64 bytes',
         '"1 safetensors files, 65 bytes'),
    ]
    for extra, edit, key, old, new in changes:
        if edit:
            kept = edit[0].read_bytes()
            edit[0].write_bytes(edit[1])
        before = _files(run["root"])
        assert launch.main(RUNG + extra) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert _files(run["root"]) == before and len(run["calls"]) == 1
        assert len(lines) == 1 and lines[0].startswith(f"error: {run['dir'] / 'moerl_run.json'}: {key} was {old}")
        assert f"when this run started, this launch has {new}" in lines[0]
        assert "start over with trainer.resume_mode=disable or a new trainer.experiment_name" in lines[0]
        if edit:
            edit[0].write_bytes(kept)


def test_a_second_launch_of_a_live_run_is_refused_naming_the_holder(run, capsys):
    run["dir"].parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from moerl.runlock import lock_run; "
                               "lock_run(sys.argv[1], create=True); print('held', flush=True); sys.stdin.read()",
                               str(run["dir"])], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(launch.__file__).parents[2])})
    try:
        assert holder.stdout.readline().strip() == "held"
        assert launch.main(RUNG + ["--dry-run"]) == 0
        assert f"is in use by process {holder.pid}: a launch now would be refused" in capsys.readouterr().out
        before = _files(run["root"])
        assert launch.main(RUNG) == 2
        err = capsys.readouterr().err
        assert f"{run['dir']} is in use by process {holder.pid}" in err and not run["calls"]
        assert _files(run["root"]) == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert launch.main(RUNG) == 0  # free again once the holder has ended


def test_a_dry_run_of_a_new_run_creates_nothing(run, capsys):
    assert launch.main(RUNG + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not (run["root"] / "ckpt").exists()
    assert f"# checkpoints: {run['dir']}: starts from scratch; a launch records this run in moerl_run.json" in out
    assert f"# one writer: a launch holds {run['dir'].parent / '.04_rung1_seed0.lock'} while main_ppo runs" in out


# The checks themselves, on one composed config (composing is the slow part of a launch)

@pytest.fixture(scope="module")
def cfg():
    return launch.prepare(EXP / "bringup" / "rung1.yaml", seed=0)[1]


def _at(cfg, run_dir: Path, **trainer):
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    c.trainer.default_local_dir = str(run_dir)
    for k, v in trainer.items():
        c.trainer[k] = v
    return c


def _refused(cfg, **kw) -> str:
    with pytest.raises(resume_check.ResumeRefused) as err:
        resume_check.inspect(cfg, **kw)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_tracker_naming_a_missing_step_is_refused(cfg, tmp_path):
    verl_save(tmp_path, 3)
    (tmp_path / TRACKER).write_text("5")
    msg = _refused(_at(cfg, tmp_path))
    assert f"{TRACKER}: names step 5 but global_step_5 is missing, so verl would train from scratch" in msg
    (tmp_path / TRACKER).write_text("five")
    assert "holds 'five', expected a step number" in _refused(_at(cfg, tmp_path))


@pytest.mark.parametrize("lost", ["data.pt", "actor/optimizer/dist_ckpt/metadata.json",
                                  "actor/model/dist_ckpt/metadata.json", "actor/extra/dist_ckpt/metadata.json"])
def test_a_step_without_what_verls_loader_reads_is_refused(cfg, tmp_path, lost):
    step = verl_save(tmp_path, 5, skip=(lost,))
    msg = _refused(_at(cfg, tmp_path))
    assert msg.startswith(f"{step}: lacks {lost}, which verl's loader reads")
    resume_path = _at(cfg, tmp_path / "elsewhere", resume_mode="resume_path", resume_from_path=str(step))
    assert f"lacks {lost}" in _refused(resume_path)


def test_steps_without_a_tracker(cfg, tmp_path):
    """Only cut-short saves: verl starts from scratch, said so; a complete step with its tracker lost
    would be trained over from scratch: refused."""
    verl_save(tmp_path, 5, skip=("data.pt",), tracker=False)
    check = resume_check.inspect(_at(cfg, tmp_path))
    assert check.resumes is None and "left alone: global_step_5" in check.notes[0]
    verl_save(tmp_path, 5, tracker=False)
    assert f"global_step_5 is complete but {TRACKER} is missing" in _refused(_at(cfg, tmp_path))
    assert resume_check.inspect(_at(cfg, tmp_path, resume_mode="disable")).resumes is None  # starting over


def test_a_checkpoint_without_a_manifest_is_resumed_only_when_adopted(cfg, tmp_path):
    verl_save(tmp_path, 5)
    assert "moerl_run.json: missing" in _refused(_at(cfg, tmp_path), arm=None, seed=0)
    check = resume_check.inspect(_at(cfg, tmp_path), seed=0, adopt=True)
    assert check.adopted and check.resumes == tmp_path / "global_step_5"
    check.record_launch()
    recorded = json.loads((tmp_path / "moerl_run.json").read_text())
    assert recorded["launches"][0]["adopted_unverified_checkpoint"] is True
    assert resume_check.inspect(_at(cfg, tmp_path), seed=0).recorded == recorded  # verified from now on
    assert "moerl.seed was 0 when this run started, this launch has 1" in _refused(_at(cfg, tmp_path), seed=1)


def test_the_fingerprint_never_reads_the_weight_shards(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    shard = tmp_path / "model-00001-of-00002.safetensors"
    shard.write_bytes(b"\0" * 10)
    shard.chmod(0)  # unreadable: a read would raise
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 5)
    try:
        fp = resume_check.base_model_fingerprint(tmp_path)
    finally:
        shard.chmod(0o644)
    assert fp["base_model.weights"].startswith("2 safetensors files, 15 bytes, listing sha256 ")
    hub = resume_check.base_model_fingerprint("moonshotai/Kimi-K2-Instruct")
    assert hub["base_model.config_json"].startswith("not fingerprinted: moonshotai/Kimi-K2-Instruct")


def test_a_start_over_moves_the_earlier_run_aside_so_a_later_relaunch_cannot_resume_it(run, capsys, monkeypatch):
    """resume_mode=disable: verl leaves the earlier steps and tracker in place until its own saves, so a
    start-over that dies before its first save, relaunched with resume_mode=auto, would load the earlier
    run's step 5 under the new run's logs. The launcher moves the earlier files aside first."""
    assert launch.main(RUNG) == 0  # the earlier run: steps 5, tracker, manifest
    capsys.readouterr()
    earlier = _files(run["dir"])
    dry = launch.main(RUNG + ["trainer.resume_mode=disable", "--dry-run"])
    out = capsys.readouterr().out
    assert dry == 0 and _files(run["dir"]) == earlier  # a dry run moves nothing
    assert "a launch moves its 3 earlier entries (global_step_5, latest_checkpointed_iteration.txt, moerl_run.json)" \
           in out and "so a later resume_mode=auto relaunch cannot resume the earlier run" in out

    def dies_before_its_first_save(cmd, env, cwd, pass_fds=()):
        assert runlock.lock_holder(run["dir"]) == str(os.getpid())  # the folder kept its lock through the move
        return 1

    monkeypatch.setattr(launch.subprocess, "call", dies_before_its_first_save)
    assert launch.main(RUNG + ["trainer.resume_mode=disable"]) == 1
    out = capsys.readouterr().out
    aside = [p for p in run["dir"].parent.iterdir() if p.name.startswith("04_rung1_seed0.before-")]
    assert len(aside) == 1 and f"moved the earlier run's files from {run['dir']} aside to {aside[0]}" in out
    assert {p.relative_to(aside[0]) for p in _files(aside[0])} == {p.relative_to(run["dir"]) for p in earlier}
    assert sorted(p.name for p in run["dir"].iterdir()) == ["moerl_run.json"]  # only the new run's record
    dry = launch.main(RUNG + ["--dry-run"])  # the relaunch with resume_mode=auto
    assert dry == 0 and f"# checkpoints: {run['dir']}: starts from scratch" in capsys.readouterr().out
