"""Launcher: dry-run prints a main_ppo command per experiment; broken constraints are named."""
from pathlib import Path

import pytest
import yaml

from moerl.verl_ext import launch

EXP = Path(__file__).resolve().parents[2] / "experiments"
RUNS = [("01_kimi_k2_lora_grpo", None), ("02_kimi_k2_lora_grpo_r3", None), ("04_moonlight_16b_a3b_r3", None)] + [
    ("03_qwen3_30b_a3b_lora_mitigations", a) for a in ("baseline", "tis", "seq_mis", "icepop", "r2", "r3", "r3_tis")]


@pytest.mark.parametrize("name,arm", RUNS)
def test_dry_run_prints_command(name, arm, capsys):
    argv = [str(EXP / name), "--dry-run"] + (["--arm", arm] if arm else [])
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert "-m verl.trainer.main_ppo" in out and "--config-name ppo_megatron_trainer" in out
    assert "actor_rollout_ref.model.lora.rank=32" in out
    assert "ok  [verl.validate_config]" in out
    # every run records its weight updates for check_first_steps.py (moerl.verl_ext.refit_log)
    assert "ok  [refit.side_log_reaches_workers]" in out
    assert f"MOERL_REFIT_LOG={launch.REPO}/logs/moerl/" in out
    assert "VERL_USE_EXTERNAL_MODULES=moerl.verl_ext.refit_log" in out
    assert f"# refit side log: {launch.REPO}/logs/moerl/" in out
    assert ".refit.jsonl (python scripts/check_first_steps" in out


def _bad(tmp_path, base, verl, moerl=None):
    """An experiment that inherits a real one and breaks one thing."""
    d = tmp_path / "98_bad"
    d.mkdir()
    (d / "experiment.yaml").write_text(yaml.safe_dump({"base": str(base), "verl": verl, **({"moerl": moerl} if moerl else {})}))
    return d


def _failed(d):
    with pytest.raises(launch.ConstraintError) as err:
        launch.prepare(d)
    return str(err.value)


K2 = EXP / "01_kimi_k2_lora_grpo" / "experiment.yaml"
MOON = EXP / "04_moonlight_16b_a3b_r3" / "experiment.yaml"


def test_r3_needs_both_flags(tmp_path):
    msg = _failed(_bad(tmp_path, MOON, {"actor_rollout_ref": {"rollout": {"enable_rollout_routing_replay": False}}}))
    assert "[r3.flags]" in msg


def test_layout_that_cannot_fit_is_rejected(tmp_path):
    msg = _failed(_bad(tmp_path, K2, {"trainer": {"nnodes": 1},
                                      "actor_rollout_ref": {"actor": {"megatron": {"pipeline_model_parallel_size": 1}},
                                                            "rollout": {"tensor_model_parallel_size": 8}}}))
    assert "[memory.fits]" in msg and "over by" in msg


def test_unknown_override_exits_2_with_file(tmp_path, capsys):
    d = _bad(tmp_path, MOON, {"actor_rollout_ref": {"actor": {"megatron": {"router_replay": {"mdoe": "R3"}}}}})
    assert launch.main([str(d), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "mdoe" in err and "98_bad/experiment.yaml" in err


def test_moerl_loss_reaches_ray_workers_with_matching_clip(tmp_path):
    """moerl.loss goes through losses.verl_overrides: the plug-in module and its knobs ride in the
    Ray runtime_env (workers see nothing else) and verl's clip keys equal moerl's."""
    from moerl.verl_ext.compose import env_for, select

    d = _bad(tmp_path, MOON, {}, moerl={"loss": {"variant": "tis", "eps_high": 0.28}})
    exp, cfg, checks, _ = launch.prepare(d)
    env_vars = select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars")
    assert env_vars["VERL_USE_EXTERNAL_MODULES"] == "moerl.verl_ext.losses,moerl.verl_ext.refit_log"
    assert '"variant":"tis"' in env_vars["MOERL_LOSS_CONFIG"]
    assert select(cfg, "actor_rollout_ref.actor.clip_ratio_high") == 0.28
    assert select(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode") == "moerl_tis"
    assert any(c.name == "loss.moerl_reaches_workers" and c.ok for c in checks)
    assert env_for(cfg)["VERL_USE_EXTERNAL_MODULES"] == env_vars["VERL_USE_EXTERNAL_MODULES"]  # the driver too


def test_cli_overrides_seed_and_wandb_group(capsys):
    argv = [str(EXP / "03_qwen3_30b_a3b_lora_mitigations"), "--arm", "r3", "--seed", "7", "--dry-run",
            "trainer.total_training_steps=20", "trainer.total_epochs=1"]
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert "trainer.total_training_steps=20" in out and "actor_rollout_ref.rollout.seed=7" in out
    assert "WANDB_RUN_GROUP=03_qwen3_30b_a3b_lora_mitigations" in out
    assert "WANDB_TAGS=03_qwen3_30b_a3b_lora_mitigations,arm:r3,seed:7,ep:4" in out
    assert "GPU-hours = 8 GPUs x 20 steps" in out


def test_refit_side_log_is_per_seed_beside_the_runs_log_and_reaches_workers():
    """A seeded bring-up rung writes its side log beside verl's file log under the seed's run name; a
    runtime env that drops the module or the path is refused by name; an empty path turns it off."""
    from omegaconf import OmegaConf

    from moerl.verl_ext.compose import select

    rung = EXP / "04_moonlight_16b_a3b_r3" / "bringup" / "rung1.yaml"
    _, cfg, _, _ = launch.prepare(rung, seed=3)
    env_vars = select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars")
    beside_file_log = Path(env_vars["VERL_FILE_LOGGER_PATH"]).parent / "04_rung1_seed3.refit.jsonl"
    assert Path(env_vars["MOERL_REFIT_LOG"]) == beside_file_log
    assert "moerl.verl_ext.refit_log" in env_vars["VERL_USE_EXTERNAL_MODULES"].split(",")

    def rule(**env):
        changed = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        changed.ray_kwargs.ray_init.runtime_env.env_vars.update(env)
        checks = []
        launch._refit_log_check(changed, lambda name, ok, detail: checks.append((name, ok, detail)))
        assert [c[0] for c in checks] == ["refit.side_log_reaches_workers"]
        return checks[0][1:]

    assert rule()[0]
    ok, detail = rule(VERL_USE_EXTERNAL_MODULES="other.module")
    assert not ok and "lacks moerl.verl_ext.refit_log" in detail and "launch through moerl.verl_ext.launch" in detail
    ok, detail = rule(MOERL_REFIT_LOG="logs/relative.refit.jsonl")
    assert not ok and "an absolute path every node sees" in detail
    ok, detail = rule(MOERL_REFIT_LOG="")
    assert ok and "set empty" in detail


RUNG1 = EXP / "04_moonlight_16b_a3b_r3" / "bringup" / "rung1.yaml"
ROWS = b'{"step":1,"data":{"actor/ppo_kl":0.0}}\n'


def _logs(cfg) -> tuple[Path, Path]:
    from moerl.verl_ext.compose import select

    env_vars = select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars")
    return Path(env_vars["VERL_FILE_LOGGER_PATH"]), Path(env_vars["MOERL_REFIT_LOG"])


def test_each_seed_of_a_rung_has_its_own_file_log_with_its_refit_log_beside_it(monkeypatch, tmp_path):
    """verl's FileLogger truncates its path, so seeds of one rung sharing a file would keep the last
    seed's rows; the refit side log sits where check_first_steps.py looks for it (X.refit.jsonl beside
    X.jsonl), also for a file log named on the command line."""
    from moerl.verl_ext import refit_log

    monkeypatch.setenv("MOERL_REPO", str(tmp_path))
    logs = {seed: _logs(launch.prepare(RUNG1, seed=seed)[1]) for seed in (0, 1)}
    assert logs[0][0] == tmp_path / "logs" / "bringup" / "04_rung1_seed0.jsonl"
    assert logs[1][0] == tmp_path / "logs" / "bringup" / "04_rung1_seed1.jsonl"
    assert all(refit_log.beside(file_log) == side for file_log, side in logs.values())
    mine = tmp_path / "mine.jsonl"
    _, cfg, _, _ = launch.prepare(RUNG1, seed=2, extra=[f"ray_kwargs.ray_init.runtime_env.env_vars."
                                                        f"VERL_FILE_LOGGER_PATH={mine}"])
    assert _logs(cfg) == (mine, tmp_path / "mine.refit.jsonl")


def test_a_launch_moves_earlier_rows_aside_before_verl_truncates_its_file_log(monkeypatch, tmp_path, capsys):
    """A re-launch (or a verl resume) of a seed keeps the rows logged before it, with the refit side log
    of that launch beside them; the other seed's file is not touched. The stand-in for main_ppo opens
    the file log the way verl's own FileLogger does."""
    from moerl.verl_ext import refit_log

    monkeypatch.setenv("MOERL_REPO", str(tmp_path))
    monkeypatch.setenv("MOERL_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    # a launch needs the model and data where it starts (rule paths.exist_where_the_job_runs)
    monkeypatch.setenv("MOERL_CKPT", str(tmp_path / "models"))
    monkeypatch.setenv("MOERL_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "models" / "tiny_moonlight").mkdir(parents=True)
    (tmp_path / "data" / "math").mkdir(parents=True)
    for split in ("train", "test"):
        (tmp_path / "data" / "math" / f"{split}.parquet").write_bytes(b"")
    folder = tmp_path / "logs" / "bringup"
    folder.mkdir(parents=True)
    (folder / "04_rung1_seed0.jsonl").write_bytes(ROWS)
    (folder / "04_rung1_seed0.refit.jsonl").write_bytes(b'{"global_steps":1}\n')
    (folder / "04_rung1_seed1.jsonl").write_bytes(b"seed 1\n")

    def main_ppo(cmd, env, cwd, pass_fds=()):
        from verl.utils.tracking import FileLogger

        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", env["VERL_FILE_LOGGER_PATH"])
        logger = FileLogger("moerl", "04_rung1_seed0")  # open(path, "wb")
        logger.log({"actor/ppo_kl": 1.0}, step=1)
        logger.finish()
        return 0

    monkeypatch.setattr(launch.subprocess, "call", main_ppo)
    assert launch.main([str(EXP / "04_moonlight_16b_a3b_r3"), "--rung", "1", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    aside = [p for p in folder.glob("04_rung1_seed0.before-*.jsonl") if not p.name.endswith(".refit.jsonl")]
    assert len(aside) == 1 and aside[0].read_bytes() == ROWS
    assert refit_log.beside(aside[0]).read_bytes() == b'{"global_steps":1}\n'
    assert b'"actor/ppo_kl":1.0' in (folder / "04_rung1_seed0.jsonl").read_bytes()
    assert not (folder / "04_rung1_seed0.refit.jsonl").exists()
    assert (folder / "04_rung1_seed1.jsonl").read_bytes() == b"seed 1\n"
    assert f"moved it aside to {aside[0].name}, so no row is lost" in out


def test_a_dry_run_reports_the_earlier_log_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MOERL_REPO", str(tmp_path))
    log = tmp_path / "logs" / "bringup" / "04_rung1_seed0.jsonl"
    log.parent.mkdir(parents=True)
    log.write_bytes(ROWS)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert launch.main([str(EXP / "04_moonlight_16b_a3b_r3"), "--rung", "1", "--seed", "0", "--dry-run"]) == 0
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert (f"# {log} holds {len(ROWS)} bytes of an earlier launch: a launch would move it aside to "
            f"04_rung1_seed0.before-") in capsys.readouterr().out


def test_earlier_logs_of_launches_within_one_second_each_keep_their_own_name(tmp_path):
    from datetime import datetime, timezone

    log = tmp_path / "r_seed0.jsonl"
    now = datetime(2026, 11, 27, 16, 45, tzinfo=timezone.utc)
    log.write_bytes(b"")
    assert launch.earlier_logs_aside({"VERL_FILE_LOGGER_PATH": str(log)}, now=now) == []  # nothing to keep
    for rows in (b"first\n", b"second\n"):
        log.write_bytes(rows)
        [(src, dst)] = launch.earlier_logs_aside({"VERL_FILE_LOGGER_PATH": str(log)}, now=now)
        src.rename(dst)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {
        "r_seed0.before-20261127T164500Z.jsonl": b"first\n", "r_seed0.before-20261127T164500Z-1.jsonl": b"second\n"}


def test_cli_override_that_breaks_a_rule_exits_2(capsys):
    argv = [str(EXP / "01_kimi_k2_lora_grpo"), "--dry-run", "actor_rollout_ref.rollout.expert_parallel_size=32"]
    assert launch.main(argv) == 2
    assert "[verl.rollout_ep_equals_tp_dp]" in capsys.readouterr().err


def _cli_failures(argv, capsys) -> str:
    """Run the launcher's dry-run; it must exit 2 with named rules and no traceback."""
    assert launch.main(argv + ["--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_lora_rank_zero_is_refused_not_full_fine_tuning(capsys):
    err = _cli_failures([str(MOON.parent), "actor_rollout_ref.model.lora.rank=0"], capsys)
    assert "[lora.rank_positive]" in err and "megatron_peft.py" in err


def test_pipeline_that_does_not_divide_names_the_rules_instead_of_crashing(capsys):
    err = _cli_failures([str(MOON.parent), "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=5"], capsys)
    assert "[megatron.world_size]" in err and "[megatron.layer_distribution]" in err
    assert "ZeroDivisionError" not in err


def test_gpu_memory_utilization_outside_vllms_range(capsys):
    err = _cli_failures([str(MOON.parent), "actor_rollout_ref.rollout.gpu_memory_utilization=1.5"], capsys)
    assert "[vllm.gpu_memory_utilization_range]" in err and "vllm/config/cache.py" in err


def test_reference_settings_without_a_reference_model(tmp_path):
    msg = _failed(_bad(tmp_path, MOON, {"actor_rollout_ref": {"ref": {"megatron": {"param_offload": True}}}}))
    assert "[verl.ref_settings_need_a_reference_model]" in msg and "ref_in_actor" in msg


def test_a_rule_that_crashes_is_its_own_failure_and_the_others_still_run(monkeypatch, capsys):
    from moerl.verl_ext import constraints as C

    def boom(spec):
        raise KeyError("something the rule did not expect")

    monkeypatch.setattr(C, "RULES", [("test.crashes", "verl 0.9.1: test", boom)] + list(C.RULES))
    err = _cli_failures([str(MOON.parent), "actor_rollout_ref.rollout.gpu_memory_utilization=1.5"], capsys)
    assert "[test.crashes] the rule could not be evaluated" in err and "KeyError" in err
    assert "[vllm.gpu_memory_utilization_range]" in err  # rules after the crashing one still ran


def test_shared_expert_adapter_needs_a_bridge_that_syncs_it_across_ep(tmp_path, monkeypatch):
    """Bridge < 0.6.0 never broadcasts the shared adapter: each EP rank trains its own copy."""
    exp, cfg, checks, _ = launch.prepare(MOON.parent)
    ok = next(c for c in checks if c.name == "bridge.shared_expert_adapter_under_ep")
    assert ok.ok and "identical on the 8 EP ranks" in ok.detail and "compare runs at one EP size" in ok.detail
    monkeypatch.setattr(launch, "bridge_version_for_run", lambda: "0.5.0")
    msg = _failed(MOON.parent)
    assert "[bridge.shared_expert_adapter_under_ep]" in msg and "the 8 copies never agree" in msg


def test_sequential_mlp_experts_would_not_share_the_adapter(tmp_path):
    d = _bad(tmp_path, MOON, {"actor_rollout_ref": {"actor": {"megatron": {"override_transformer_config": {
        "+moe_grouped_gemm": False}}}}})
    assert "[bridge.shared_expert_adapter_under_ep]" in _failed(d)
