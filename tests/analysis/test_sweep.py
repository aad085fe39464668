"""scripts/sweep.py: skip/resume/fresh decisions, command construction, the local runner with a
stand-in run.py (no training), and one real tiny run through the sweep."""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from tests_helpers import load_script

REPO = Path(__file__).resolve().parents[2]
EXP_DIR = REPO / "experiments" / "00_tiny_moe_cpu"

sweep = load_script("scripts/sweep.py", "moerl_sweep_script")

# A stand-in for scripts/run.py: resolves the run directory exactly as run.py does, records its
# argv and thread env there, and writes summary.json (or fails for the arm named in $FAKE_FAIL_ARM).
FAKE_RUN = '''
import json, os, sys
from pathlib import Path
from moerl.config import load_config
args = sys.argv[1:]
seed = int(args[args.index("--seed") + 1])
action = "--resume" if "--resume" in args else "--fresh"
pos = [a for a in args if not a.startswith("--") and a != str(seed)]
cfg = load_config(pos[0], pos[1:] + [f"seed={seed}"])
run = cfg.run_dir
run.mkdir(parents=True, exist_ok=True)
with open(run / "calls.jsonl", "a") as fh:
    fh.write(json.dumps({"argv": args, "omp": os.environ["OMP_NUM_THREADS"], "threads": cfg.threads,
                         "action": action}) + "\\n")
print("fake run of", run)
if os.environ.get("FAKE_KILL_SWEEP_ARM") == cfg.arm:  # the sweep dies as at a session's end
    import signal
    os.kill(os.getppid(), signal.SIGKILL)
    sys.exit(9)
if os.environ.get("FAKE_DAMAGE_RECORD"):  # something else breaks sweep.json while the runs run
    Path(os.environ["FAKE_DAMAGE_RECORD"]).write_text('{"invocations": [')
if os.environ.get("FAKE_FAIL_ARM") == cfg.arm:
    sys.exit(3)
(run / "summary.json").write_text("{}")
'''


# A stand-in for scripts/warm_start.py: writes the cache entry the config points at, counts calls.
FAKE_WARM_START = '''
import json, sys
from pathlib import Path
from moerl.config import load_config
from moerl.trainer.warm_start import warm_start_dir
path = warm_start_dir(load_config(sys.argv[1], sys.argv[2:]))
path.mkdir(parents=True)
(path / "meta.json").write_text(json.dumps({"argv": sys.argv[1:]}))
with open(path.parent / "calls.txt", "a") as fh:
    fh.write(path.name + "\\n")
'''


@pytest.fixture
def fake_run(tmp_path):
    path = tmp_path / "fake_run.py"
    path.write_text(FAKE_RUN)
    return path


@pytest.fixture
def fake_warm_start(tmp_path):
    path = tmp_path / "fake_warm_start.py"
    path.write_text(FAKE_WARM_START)
    return path


def _ckpt(run: Path, step: int, complete: bool = True) -> None:
    d = run / "checkpoints" / (f"step_{step}" if complete else f".step_{step}.tmp")
    d.mkdir(parents=True)
    if complete:
        (d / "state.json").write_text("{}")


def test_decide(tmp_path):
    run = tmp_path / "seed0"
    assert sweep.decide(run) == "fresh"                  # nothing there
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    assert sweep.decide(run) == "fresh"                  # killed before its first checkpoint
    _ckpt(run, 10, complete=False)
    assert sweep.decide(run) == "fresh"                  # a half-written checkpoint is not one
    _ckpt(run, 10)
    assert sweep.decide(run) == "resume"
    (run / "summary.json").write_text("{}")
    assert sweep.decide(run) == "skip"


def test_build_command_and_threads():
    cmd = sweep.build_command("py", "exp/arms/r3.yaml", 2, "resume", 1, ["trainer.steps=4"], "run.py")
    # options before the config: run.py's positional overrides are greedy
    assert cmd == ["py", "run.py", "--seed", "2", "--no-progress", "--resume", "exp/arms/r3.yaml", "threads=1",
                   "trainer.steps=4"]
    assert sweep.build_command("py", "c.yaml", 0, "fresh", 2, [], "run.py")[5] == "--fresh"
    with pytest.raises(ValueError, match="resume or fresh"):
        sweep.build_command("py", "c.yaml", 0, "skip", 1, [])
    assert [sweep.threads_per_job(2, j) for j in (1, 2, 3)] == [2, 1, 1]
    assert sweep.threads_per_job(16, 3) == 5
    env = sweep.job_env(3, {"PATH": "/bin"})
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3" and env["PATH"] == "/bin"


def test_plan_decides_per_run_and_validates(tmp_path):
    out = tmp_path / "runs"
    finished = out / "00_tiny_moe_cpu" / "baseline" / "seed0"
    finished.mkdir(parents=True)
    (finished / "summary.json").write_text("{}")
    _ckpt(out / "00_tiny_moe_cpu" / "baseline" / "seed1", 10)
    exp, exp_out, jobs = sweep.plan(EXP_DIR, [0, 1, 2], ["baseline", "r3"], [f"tracking.output_dir={out}"], 1)
    assert exp == "00_tiny_moe_cpu" and exp_out == out / "00_tiny_moe_cpu"
    actions = {(j.arm, j.seed): j.action for j in jobs}
    assert actions == {("baseline", 0): "skip", ("baseline", 1): "resume", ("baseline", 2): "fresh",
                       ("r3", 0): "fresh", ("r3", 1): "fresh", ("r3", 2): "fresh"}
    skip = next(j for j in jobs if j.action == "skip")
    assert skip.command == []
    resume = next(j for j in jobs if j.action == "resume")
    assert "--resume" in resume.command and resume.command[-1] == f"tracking.output_dir={out}"
    assert resume.log == str(exp_out / "sweep_logs" / "baseline-seed1.log")
    # all arms by default
    _, _, every = sweep.plan(EXP_DIR, [0], None, [f"tracking.output_dir={out}"], 1)
    assert {j.arm for j in every} == {p.stem for p in (EXP_DIR / "arms").glob("*.yaml")}
    with pytest.raises(SystemExit, match=r"unknown arm\(s\) \['nope'\].*baseline"):
        sweep.plan(EXP_DIR, [0], ["nope"], [], 1)
    with pytest.raises(SystemExit, match="config error.*trainer.stepz"):
        sweep.plan(EXP_DIR, [0], ["r3"], ["trainer.stepz=3"], 1)


def test_runs_start_arm_by_arm_or_seed_by_seed_and_an_interrupted_run_first():
    def job(arm, seed, action="fresh"):
        return sweep.Job(arm, seed, f"{arm}.yaml", f"runs/{arm}/seed{seed}", action, "log")

    jobs = [job("a", 0, "skip"), job("a", 1), job("b", 0), job("b", 1, "resume"), job("c", 0), job("c", 1)]
    by_arm = [(j.arm, j.seed) for j in sweep.order_jobs(jobs, "arm")]
    assert by_arm == [("b", 1), ("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1)]
    by_seed = [(j.arm, j.seed) for j in sweep.order_jobs(jobs, "seed")]
    assert by_seed == [("b", 1), ("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1)]
    with pytest.raises(SystemExit, match="--order diagonal: expected arm or seed"):
        sweep.order_jobs(jobs, "diagonal")


def test_sweep_runs_resumes_and_skips(tmp_path, fake_run, fake_warm_start, monkeypatch, capsys):
    out = tmp_path / "runs"
    exp_out = out / "00_tiny_moe_cpu"
    v = "+trainer.steps-3"  # the override is part of every run's name (warm_start.cache_dir is not)
    _ckpt(exp_out / f"r3{v}" / "seed1", 5)  # an interrupted run
    monkeypatch.setenv("FAKE_FAIL_ARM", "tis")
    ws = tmp_path / "ws"
    argv = [str(EXP_DIR), "--seeds", "2", "--arms", "baseline,r3,tis,deepseek_r3", "--jobs", "2",
            "--output-dir", str(out), "--run-script", str(fake_run), "--warm-start-script", str(fake_warm_start),
            "trainer.steps=3", f"warm_start.cache_dir={ws}"]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    assert sweep.main(argv) == 1  # tis fails
    # the sweep's stop-the-runs handlers end with it: a process that forks or is terminated later must not
    # inherit them (a forked pool worker that catches SIGTERM outlives Pool.terminate)
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    text = capsys.readouterr().out
    # the uncached warm starts were trained once each before the runs: one for the qwen3_moe arms
    # (baseline, r3, tis share model/data/warm-start config), one for deepseek_r3
    calls = sorted((ws / "calls.txt").read_text().split())
    assert len(calls) == 2 and calls[0].startswith("deepseek_v3-") and calls[1].startswith("qwen3_moe-")
    assert "2 warm-start checkpoint(s) to train first" in text
    assert "FAILED (rc 3" in text and f"tis{v}-seed0.log" in text and "arm | seed | action | status | seconds" in text
    calls = {(a, s): [json.loads(x)
                      for x in (exp_out / f"{a}{v}" / f"seed{s}" / "calls.jsonl").read_text().splitlines()]
             for a in ("baseline", "r3", "tis", "deepseek_r3") for s in (0, 1)}
    assert calls[("r3", 1)][0]["action"] == "--resume" and calls[("r3", 0)][0]["action"] == "--fresh"
    cores = sweep.usable_cores()
    for c in calls.values():  # each of 2 concurrent runs gets cores // 2 threads, in env and config
        assert c[0]["omp"] == str(sweep.threads_per_job(cores, 2)) == str(c[0]["threads"])
        assert "trainer.steps=3" in c[0]["argv"]
    assert "fake run of" in (exp_out / "sweep_logs" / f"baseline{v}-seed0.log").read_text()
    first = json.loads((exp_out / "sweep.json").read_text())
    assert first["runs"][f"tis{v}/seed0"]["rc"] == 3 and first["runs"][f"baseline{v}/seed1"]["rc"] == 0

    # second invocation: finished runs are skipped, only the failed arm runs again
    monkeypatch.delenv("FAKE_FAIL_ARM")
    assert sweep.main(argv) == 0
    assert len(calls[("baseline", 0)]) == 1
    assert len((exp_out / f"baseline{v}" / "seed0" / "calls.jsonl").read_text().splitlines()) == 1
    assert len((exp_out / f"tis{v}" / "seed0" / "calls.jsonl").read_text().splitlines()) == 2
    data = json.loads((exp_out / "sweep.json").read_text())
    assert len(data["invocations"]) == 2 and data["runs"][f"tis{v}/seed0"] == {
        "seconds": pytest.approx(data["runs"][f"tis{v}/seed0"]["seconds"]), "attempts": 2, "rc": 0}
    assert data["total_wall_seconds"] == pytest.approx(sum(i["wall_seconds"] for i in data["invocations"]))

    # third: nothing to do; recorded but not counted as sweep time
    assert sweep.main(argv) == 0
    data3 = json.loads((exp_out / "sweep.json").read_text())
    assert not data3["invocations"][-1]["ran"] and data3["total_wall_seconds"] == data["total_wall_seconds"]
    assert data3["invocations"][-1]["all_finished"] == len(data["runs"]) == 8 and "results" not in data3["invocations"][-1]
    assert len((ws / "calls.txt").read_text().split()) == 2  # cached now: never retrained


def test_runs_wait_for_a_failed_warm_start(tmp_path, fake_run, capsys):
    failing = tmp_path / "fail_ws.py"
    failing.write_text("import sys; print('warm start broke'); sys.exit(5)")
    out = tmp_path / "runs"
    argv = [str(EXP_DIR), "--seeds", "1", "--arms", "baseline", "--output-dir", str(out), "--run-script",
            str(fake_run), "--warm-start-script", str(failing), f"warm_start.cache_dir={tmp_path / 'ws'}"]
    assert sweep.main(argv) == 1
    text = capsys.readouterr().out
    assert "not started: its warm start failed" in text
    assert not (out / "00_tiny_moe_cpu" / "baseline" / "seed0").exists()
    assert "warm start broke" in next((out / "00_tiny_moe_cpu" / "sweep_logs").glob("warm_start-*.log")).read_text()


def test_sweep_as_ray_tasks(tmp_path, fake_run, monkeypatch):
    """--ray on a local Ray (RAY_ADDRESS unset): the same jobs as Ray tasks, recorded the same way."""
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "runs"
    argv = [str(EXP_DIR), "--seeds", "1", "--arms", "baseline,r3", "--ray", "--output-dir", str(out),
            "--run-script", str(fake_run), "warm_start.enabled=false"]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    assert sweep.main(argv) == 0
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # not ray.init's SIGTERM handler
    data = json.loads((out / "00_tiny_moe_cpu" / "sweep.json").read_text())
    v = "+warm_start.enabled-false"
    assert data["invocations"][0]["ray"] and set(data["runs"]) == {f"baseline{v}/seed0", f"r3{v}/seed0"}
    assert all((out / "00_tiny_moe_cpu" / f"{a}{v}" / "seed0" / "summary.json").exists() for a in ("baseline", "r3"))


def test_one_real_tiny_run_through_the_sweep(tmp_path, capsys):
    """scripts/run.py for real: 1 GRPO step of a random-init policy, 2 prompts x 2 samples."""
    out = tmp_path / "runs"
    argv = [str(EXP_DIR), "--seed-list", "0", "--arms", "r3", "--jobs", "1", "--threads", "1",
            "--output-dir", str(out), "warm_start.enabled=false", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "trainer.steps=1", "trainer.mini_batches=1", "trainer.eval_size=4", "trainer.eval_every=0",
            "trainer.samples_every=1", "trainer.samples_per_save=8", "tracking.wandb_mode=disabled",
            "data.train_size=64", "data.test_size=4"]
    rc = sweep.main(argv)
    from moerl.config import load_config

    run = load_config(EXP_DIR / "arms" / "r3.yaml", argv[argv.index("--output-dir") + 2:]
                      + [f"tracking.output_dir={out}"]).run_dir
    log = (out / "00_tiny_moe_cpu" / "sweep_logs" / f"{run.parent.name}-seed0.log").read_text()
    assert rc == 0, log[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and (run / "samples" / "step_00001.npz").exists()
    from moerl.analysis.results import load_run

    assert load_run(out, "00_tiny_moe_cpu", run.parent.name, 0)["routing/agreement"].notna().any()
    assert sweep.main(argv) == 0 and "skipped (finished)" in capsys.readouterr().out


def test_sweep_refuses_runs_of_another_config_and_names_override_runs(tmp_path, capsys):
    from moerl.config import load_config, to_dict
    import yaml

    out = tmp_path / "runs"
    plain = load_config(EXP_DIR / "arms" / "tis.yaml", [f"tracking.output_dir={out}"])
    plain.run_dir.mkdir(parents=True)
    (plain.run_dir / "summary.json").write_text("{}")
    (plain.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(plain)))
    # an override is a run of its own: the finished plain arm is neither skipped for it nor resumed
    _, _, jobs = sweep.plan(EXP_DIR, [0], ["tis"], [f"tracking.output_dir={out}", "loss.tis_cap=3.0"], 1)
    assert [(j.arm, j.action) for j in jobs] == [("tis+loss.tis_cap-3.0", "fresh")]
    assert jobs[0].run_dir == str(out / "00_tiny_moe_cpu" / "tis+loss.tis_cap-3.0" / "seed0")
    _, _, jobs = sweep.plan(EXP_DIR, [0], ["tis"], [f"tracking.output_dir={out}"], 1)
    assert [(j.arm, j.action) for j in jobs] == [("tis", "skip")]
    # the arm file changed since the run was recorded: neither skipped nor resumed, the keys named
    recorded = to_dict(plain)
    recorded["loss"]["tis_cap"] = 5.0
    (plain.run_dir / "config.yaml").write_text(yaml.safe_dump(recorded))
    with pytest.raises(SystemExit, match=r"holds a run of another config, cannot skip it \(loss.tis_cap: 5.0 -> 2.0\)"):
        sweep.plan(EXP_DIR, [0], ["tis"], [f"tracking.output_dir={out}"], 1)
    # errors are one line; --debug shows the traceback
    with pytest.raises(SystemExit, match=r"^holds|holds a run of another config") as err:
        sweep.main([str(EXP_DIR), "--seed-list", "0", "--arms", "tis", "--output-dir", str(out), "--dry-run"])
    assert "\n" not in str(err.value)


def test_two_arms_that_compute_the_same_thing_are_refused(tmp_path):
    exp = tmp_path / "exp"
    shutil.copytree(EXP_DIR / "arms", exp / "arms")
    shutil.copy(EXP_DIR / "base.yaml", exp / "base.yaml")
    (exp / "arms" / "per_expert.yaml").write_text("base: ../base.yaml\narm: per_expert\nlora:\n  expert_mode: per_expert\n")
    out = [f"tracking.output_dir={tmp_path / 'runs'}"]
    with pytest.raises(SystemExit, match=r"arm 'per_expert' resolves to the same config as arm 'baseline'"):
        sweep.plan(exp, [0], ["baseline", "per_expert"], out, 1)
    # every arm shipped with experiment 00 computes something of its own
    _, _, jobs = sweep.plan(EXP_DIR, [0], None, out, 1)
    assert len(jobs) == len(list((EXP_DIR / "arms").glob("*.yaml")))


def _one_invocation(out_dir: Path, i: int) -> None:
    """One sweep invocation's record: started, one run landed, finished (a worker of the test below)."""
    record = sweep.InvocationRecord(out_dir, {"started": "2026-01-01T00:00:00"})  # the same second for all
    record.add(sweep.Result(f"a{i}", 0, "fresh", 0, 1.0, "log", "run"))
    record.finish([])


def test_sweeps_side_by_side_keep_every_entry(tmp_path):
    """Two sweeps of one experiment (one per rung) write to the same sweep.json: none is lost."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    # workers die on Pool.terminate's SIGTERM even if an earlier test left a handler in this process
    with ctx.Pool(4, initializer=signal.signal, initargs=(signal.SIGTERM, signal.SIG_DFL)) as pool:
        pool.starmap(_one_invocation, [(tmp_path, i) for i in range(24)])
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert len(data["invocations"]) == 24 and len(data["runs"]) == 24
    assert all(inv["complete"] for inv in data["invocations"]) and len({inv["id"] for inv in data["invocations"]}) == 24
    assert sum(inv["wall_seconds"] for inv in data["invocations"]) == pytest.approx(data["total_wall_seconds"])


# A stand-in run.py that trains slowly: one metrics row per step (as the trainer writes them), then a summary.
SLOW_RUN = '''
import json, sys, time
from moerl.config import load_config
args = sys.argv[1:]
seed = int(args[args.index("--seed") + 1])
pos = [a for a in args if not a.startswith("--") and a != str(seed)]
cfg = load_config(pos[0], pos[1:] + [f"seed={seed}"])
run = cfg.run_dir
run.mkdir(parents=True, exist_ok=True)
for step in range(1, cfg.trainer.steps + 1):
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": step, "reward/mean": 0.25 * step, "mismatch/k3": 1e-4 * step,
                             "time/step": 0.4}) + "\\n")
    time.sleep(0.4)
(run / "summary.json").write_text(json.dumps({"steps": cfg.trainer.steps, "reward_last10": 0.5,
    "mean/mismatch/k3": 2e-4, "initial_eval": {"eval/pass1": 0.25}, "final_eval": {"eval/pass1": 0.375}}))
'''


def test_heartbeat_reports_each_running_run_and_the_sweep(tmp_path):
    run = tmp_path / "r3" / "seed1"
    run.mkdir(parents=True)
    rows = [{"step": 0, "eval/pass1": 0.3}, {"step": 1, "reward/mean": 0.5, "mismatch/k3": 3e-4, "time/step": 10.0},
            {"step": 2, "reward/mean": 0.75, "mismatch/k3": 2e-4, "time/step": 20.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')  # mid-write
    job = sweep.Job("r3", 1, "r3.yaml", str(run), "fresh", "log", steps=60)
    starting = sweep.Job("tis", 0, "tis.yaml", str(tmp_path / "tis" / "seed0"), "fresh", "log2", steps=60)
    done = [sweep.Result("baseline", 0, "fresh", 0, 600.0, "log0")]
    lines = sweep.heartbeat_lines([job, starting], total=5, finished=done, n_jobs=2, elapsed=3725)
    assert lines[0].endswith("r3 seed1: step 2/60, reward 0.750, k3 2.00e-04, run ETA 0:14:30")  # 58 steps x 15 s
    assert lines[1].endswith("tis seed0: starting (no step logged yet)")
    # 2 queued runs of 600 s and 870 s left on the running ones, over 2 parallel slots
    assert lines[2].endswith("1/5 done, 2 running, 2 queued; 1:02:05 elapsed, sweep ETA about 0:17:15")
    # a resumed run finished in 60 s: it covered only its last steps, so it does not set the pace
    resumed = sweep.Result("baseline", 1, "resume", 0, 60.0, "log1")
    lines = sweep.heartbeat_lines([job, starting], total=6, finished=[*done, resumed], n_jobs=2, elapsed=3725)
    assert lines[2].endswith("2/6 done, 2 running, 2 queued; 1:02:05 elapsed, sweep ETA about 0:17:15")


def test_a_blind_sweep_prints_progress_but_no_outcome(tmp_path):
    """A registered grid's verdicts are sealed until its last run lands: its sweep's progress lines and
    closing table name steps and times, never a reward, k3 or pass@1."""
    run = tmp_path / "r3" / "seed1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 4, "reward/mean": 0.625, "mismatch/k3": 3e-4,
                                                   "time/step": 10.0}) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 60, "reward_last10": 0.625, "mean/mismatch/k3": 3e-4,
                                                  "initial_eval": {"eval/pass1": 0.25},
                                                  "final_eval": {"eval/pass1": 0.375}}))
    job = sweep.Job("r3", 1, "r3.yaml", str(run), "fresh", "log", steps=60)
    seen = sweep.heartbeat_lines([job], total=1, finished=[], n_jobs=1, elapsed=60)[0]
    blind = sweep.heartbeat_lines([job], total=1, finished=[], n_jobs=1, elapsed=60, blind=True)[0]
    assert "reward 0.625" in seen and "k3 3.00e-04" in seen
    assert blind.endswith("r3 seed1: step 4/60, run ETA 0:09:20") and "0.625" not in blind
    done = [sweep.Result("r3", 1, "fresh", 0, 600.0, "log", str(run))]
    assert "0.625" in sweep.table(done) and "0.375" in sweep.table(done)
    header, _, row = sweep.table(done, blind=True).splitlines()
    assert header == "arm | seed | action | status | seconds | steps"
    assert row == "r3 | 1 | fresh | ok | 600 | 60"


def test_a_run_that_logs_nothing_for_long_is_named_as_stalled(tmp_path):
    """A run stuck inside one call (a reward that never returned) kept showing the same step and ETA for as
    long as it hung; the heartbeat now says how long nothing was logged, against the run's step time."""
    import os
    import time

    run = tmp_path / "baseline" / "seed3"
    run.mkdir(parents=True)
    metrics = run / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 462, "reward/mean": 0.0, "time/step": 3.2}) + "\n")
    job = sweep.Job("baseline", 3, "baseline.yaml", str(run), "resume", "log", steps=600)
    line = sweep.heartbeat_lines([job], total=1, finished=[], n_jobs=1, elapsed=60, blind=True)[0]
    assert line.endswith("step 462/600, run ETA 0:07:22")  # just written: no note
    os.utime(metrics, (time.time() - 25 * 60,) * 2)
    line = sweep.heartbeat_lines([job], total=1, finished=[], n_jobs=1, elapsed=60, blind=True)[0]
    assert line.endswith("run ETA 0:07:22; nothing logged for 25 min (a step takes 3.2 s): stalled?")
    # an evaluation between steps is not a stall: under STALL_MIN_SECONDS nothing is said
    os.utime(metrics, (time.time() - sweep.STALL_MIN_SECONDS + 60,) * 2)
    assert "stalled" not in sweep.heartbeat_lines([job], 1, [], 1, 60)[0]


def test_sweep_prints_a_heartbeat_while_runs_train_and_a_summary_table(tmp_path, capsys):
    slow = tmp_path / "slow_run.py"
    slow.write_text(SLOW_RUN)
    argv = [str(EXP_DIR), "--seeds", "1", "--arms", "baseline,r3", "--jobs", "2", "--heartbeat", "0.5",
            "--output-dir", str(tmp_path / "runs"), "--run-script", str(slow), "warm_start.enabled=false",
            "trainer.steps=5"]
    assert sweep.main(argv) == 0
    text = capsys.readouterr().out
    beats = [line for line in text.splitlines() if "trainer.steps-5 seed0: step " in line]
    assert beats and all("/5, reward " in b and ", k3 " in b and "run ETA" in b for b in beats)
    assert any("sweep ETA about" in line for line in text.splitlines())
    assert "| steps | reward (last 10) | k3 (run mean) | pass@1 start -> end" in text
    assert "| 5 | 0.500 | 2.00e-04 | 0.250 -> 0.375" in text


def test_a_killed_sweep_keeps_the_runs_it_finished(tmp_path, fake_run):
    """A grid outlives a session: its sweep is killed at the session's end. sweep.json holds every run the
    sweep finished before the kill, with its time (the entry is written as each run lands), and the next
    invocation adds its own."""
    import os
    import subprocess
    import sys

    out = tmp_path / "runs"
    argv = [sys.executable, str(REPO / "scripts" / "sweep.py"), str(EXP_DIR), "--arms", "baseline,r3", "--seeds", "1",
            "--jobs", "1", "--output-dir", str(out), "--run-script", str(fake_run), "--heartbeat", "0",
            "warm_start.enabled=false"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "FAKE_KILL_SWEEP_ARM": "r3"}
    killed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    data = json.loads((out / "00_tiny_moe_cpu" / "sweep.json").read_text())
    (first,) = data["invocations"]
    assert first["ran"] and not first["complete"] and first["wall_seconds"] > 0
    base, r3 = "baseline+warm_start.enabled-false", "r3+warm_start.enabled-false"  # arms as the overrides name them
    assert [(r["arm"], r["rc"]) for r in first["results"]] == [(base, 0)]
    assert data["runs"] == {f"{base}/seed0": {"seconds": pytest.approx(first["results"][0]["seconds"]),
                                              "attempts": 1, "rc": 0}}
    assert data["total_wall_seconds"] == pytest.approx(first["wall_seconds"])

    env.pop("FAKE_KILL_SWEEP_ARM")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads((out / "00_tiny_moe_cpu" / "sweep.json").read_text())
    assert data["invocations"][0] == first and data["invocations"][1]["complete"]
    assert [(r["arm"], r["action"]) for r in data["invocations"][1]["results"]] == [(r3, "fresh"), (base, "skip")]
    # the killed attempt of r3 never landed: only the attempt that finished it is counted
    assert set(data["runs"]) == {f"{base}/seed0", f"{r3}/seed0"} and data["runs"][f"{r3}/seed0"]["attempts"] == 1


def test_a_record_damaged_while_the_runs_run_keeps_them_going_and_the_entry_beside_it(tmp_path, fake_run, monkeypatch):
    out = tmp_path / "runs"
    record = out / "00_tiny_moe_cpu" / "sweep.json"
    monkeypatch.setenv("FAKE_DAMAGE_RECORD", str(record))
    with pytest.raises(SystemExit) as err:
        sweep.main([str(EXP_DIR), "--arms", "baseline,r3", "--seeds", "1", "--jobs", "1", "--output-dir", str(out),
                    "--run-script", str(fake_run), "--heartbeat", "0", "warm_start.enabled=false"])
    assert str(err.value.code).startswith(f"{record}: not a readable sweep record (")
    (aside,) = record.parent.glob("sweep.invocation-*.json")
    assert str(aside) in str(err.value.code) and record.read_text() == '{"invocations": ['
    entry = json.loads(aside.read_text())
    assert entry["complete"] and sorted(r["arm"].split("+")[0] for r in entry["results"]) == ["baseline", "r3"]
    assert all(r["rc"] == 0 for r in entry["results"])  # both runs ran to the end


def test_a_run_another_process_holds_is_busy_not_failed_and_adds_no_time(tmp_path, capsys):
    """Two identical sweeps on one directory: the run the other holds is reported busy (scripts/run.py exits
    with BUSY_EXIT_CODE), not FAILED, and neither the refused attempt's time nor an attempt is added."""
    from moerl.config import load_config
    from moerl.runlock import lock_run, unlock_run

    out = tmp_path / "runs"
    overrides = ["warm_start.enabled=false", "trainer.steps=1"]
    run_dir = load_config(str(EXP_DIR / "arms" / "baseline.yaml"), [*overrides, f"tracking.output_dir={out}",
                                                                    "seed=0"]).run_dir
    lock_run(run_dir, create=True)  # the other sweep's live run
    try:
        rc = sweep.main([str(EXP_DIR), "--arms", "baseline", "--seeds", "1", "--jobs", "1", "--output-dir", str(out),
                         "--heartbeat", "0", *overrides])
    finally:
        unlock_run(run_dir)
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "busy (another process is running it; not run here)" in printed and "FAILED" not in printed, printed
    assert "0 failed; 1 busy (run by another process)" in printed, printed
    record = json.loads((out / "00_tiny_moe_cpu" / "sweep.json").read_text())
    assert record.get("runs", {}) == {}, record
