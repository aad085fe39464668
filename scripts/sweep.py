"""Run every arm x seed of an experiment: several processes at a time on one machine, or as Ray tasks.

    python scripts/sweep.py experiments/00_tiny_moe_cpu --seeds 3 [--arms a,b] [--jobs N] [--ray]
                            [--output-dir runs] [--debug] [key=value ...]

Overrides that change what the runs compute are part of each run's name
(``<arm>+loss.tis_cap-3.0/seed0``: a name a shell and a glob take as it is), so they never skip or resume
the runs of the plain arms; runs recorded under the older ``key=value,...`` spelling are still found.
Resumable: a run whose directory holds summary.json is skipped; one with a checkpoint is continued
with ``run.py --resume``; either only if the run was recorded with the same config (the keys that
differ are named otherwise); anything else starts with ``run.py --fresh`` (a partial directory without a
checkpoint is moved aside, never deleted). Each of the N concurrent runs gets
``threads = max(1, cores // N)`` (torch threads and OMP/MKL env), so N runs share the machine
instead of oversubscribing it. Every run writes a log to ``<output>/<experiment>/sweep_logs/``.
The sweep's wall time and each run's time are appended to ``<output>/<experiment>/sweep.json``
(one entry per invocation, written when it starts and after every run that lands, so a sweep stopped
from outside keeps the runs it finished; scripts/write_results.py reports the total).

The sweep owns its runs: each is started in a process group of its own and dies with the sweep
(SIGTERM or SIGINT to the sweep stops them, and a sweep killed with SIGKILL takes them along through
the parent-death signal), so a re-run never finds a run of the previous sweep still writing.

With ``--ray`` the same runs are Ray tasks (``ray.init(address=$RAY_ADDRESS)``, a local Ray when
unset), each asking for ``threads`` CPUs; on a cluster the repository and the output directory must
be on a filesystem every node sees.
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
RUN_SCRIPT = REPO / "scripts" / "run.py"
WARM_START_SCRIPT = REPO / "scripts" / "warm_start.py"


@dataclass
class Job:
    arm: str
    seed: int
    config: str          # the arm YAML
    run_dir: str         # <output>/<experiment>/<arm>/seed<k>
    action: str          # skip | resume | fresh | warm_start
    log: str
    command: list[str] = field(default_factory=list)
    warm_start: str | None = None  # the uncached warm-start checkpoint this run would train first
    steps: int = 0       # trainer.steps: the heartbeat's "step k/N" and ETA


@dataclass
class Result:
    arm: str
    seed: int
    action: str
    rc: int | None       # None: skipped
    seconds: float
    log: str
    run_dir: str = ""


def usable_cores() -> int:
    from moerl.config import usable_cores as cores

    return cores()


def threads_per_job(cores: int, jobs: int) -> int:
    return max(1, cores // max(1, jobs))


def decide(run_dir: Path) -> str:
    """skip (finished: summary.json), resume (a completed checkpoint), else fresh."""
    if (run_dir / "summary.json").exists():
        return "skip"
    ckpt = run_dir / "checkpoints"
    # The trainer writes a checkpoint to .step_N.tmp and renames it; state.json marks a complete one
    # (same rule as moerl.trainer.checkpoint.checkpoint_dirs).
    if ckpt.is_dir() and any((p / "state.json").exists() for p in ckpt.glob("step_*")):
        return "resume"
    return "fresh"


def build_command(python: str, config: str, seed: int, action: str, threads: int,
                  overrides: list[str], run_script: str | Path = RUN_SCRIPT) -> list[str]:
    """run.py takes its options before the config (its positional overrides are greedy)."""
    if action not in ("resume", "fresh"):
        raise ValueError(f"build_command: action must be resume or fresh, got {action!r}")
    # --unless-started: the plan may be stale by the time the run starts (a sweep beside this one got to the
    # run first); run.py then leaves a finished run alone and continues a checkpointed one.
    extra = ["--unless-started"] if action == "fresh" else []
    return [python, str(run_script), "--seed", str(seed), "--no-progress", f"--{action}", *extra,
            config, f"threads={threads}", *overrides]


def job_env(threads: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[key] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    return env


def discover_arms(experiment_dir: Path, wanted: list[str] | None) -> dict[str, Path]:
    arms_dir = experiment_dir / "arms"
    if not arms_dir.is_dir():
        raise SystemExit(f"{arms_dir}: no arms directory (expected {experiment_dir}/arms/<arm>.yaml)")
    arms = {p.stem: p for p in sorted(arms_dir.glob("*.yaml"))}
    if not arms:
        raise SystemExit(f"{arms_dir}: no arm YAML files")
    if wanted:
        from moerl.config import current_arm

        wanted = [current_arm(experiment_dir.name, a) for a in wanted]  # an arm's former name: its current one
        unknown = [a for a in wanted if a not in arms]
        if unknown:
            raise SystemExit(f"unknown arm(s) {unknown} in {arms_dir} (have: {sorted(arms)})")
        arms = {a: arms[a] for a in wanted}
    return arms


def plan(experiment_dir: Path, seeds: list[int], arms: list[str] | None, overrides: list[str],
         threads: int, python: str = sys.executable, run_script: str | Path = RUN_SCRIPT) -> tuple[str, Path, list[Job]]:
    """Resolve every arm x seed through the config loader (so a bad override fails before anything
    runs) and decide what each run needs. Returns (experiment name, experiment output dir, jobs)."""
    from moerl.config import ConfigError, load_config
    from moerl.identity import inputs_record
    from moerl.tracking import RunMismatchError, check_same_config, check_same_inputs

    jobs, experiment, out_dir = [], None, None
    computes: dict[str, str] = {}  # what an arm computes (its identity without its name) -> arm
    for arm, path in discover_arms(experiment_dir, arms).items():
        for seed in seeds:
            try:
                cfg = load_config(str(path), [*overrides, f"seed={seed}"])
            except ConfigError as err:
                raise SystemExit(f"config error in {path} (seed {seed}): {err}") from None
            same_as = computes.setdefault(_computation(cfg), arm)
            if same_as != arm:
                raise SystemExit(f"{path}: arm '{arm}' resolves to the same config as arm '{same_as}' (seed {seed}): "
                                 f"its runs would duplicate that arm's; drop it or make it differ")
            if experiment is None:
                experiment, out_dir = cfg.experiment, Path(cfg.tracking.output_dir) / cfg.experiment
            elif cfg.experiment != experiment:
                raise SystemExit(f"{path}: experiment is {cfg.experiment!r}, the other arms say {experiment!r}")
            run_dir = cfg.run_dir
            action = decide(run_dir)
            if action != "fresh":
                try:
                    check_same_config(run_dir, cfg, action)
                    # the content of its data files and base config, as far as they exist yet
                    ws_dir = None
                    if cfg.warm_start.enabled:
                        from moerl.trainer.warm_start import warm_start_dir

                        ws_dir = warm_start_dir(cfg)
                    check_same_inputs(run_dir, inputs_record(cfg, ws_dir), action)
                except (RunMismatchError, FileNotFoundError) as err:
                    raise SystemExit(str(err)) from None
            warm = None
            if cfg.warm_start.enabled and action != "skip":
                from moerl.trainer.warm_start import warm_start_dir

                ws_dir = warm_start_dir(cfg)
                warm = None if (ws_dir / "meta.json").exists() else str(ws_dir)
            name = run_dir.parent.name  # the arm, plus the overrides that change it
            log = out_dir / "sweep_logs" / f"{name}-seed{cfg.seed}.log"
            cmd = [] if action == "skip" else build_command(python, str(path), seed, action, threads, overrides,
                                                            run_script)
            jobs.append(Job(name, seed, str(path), str(run_dir), action, str(log), cmd, warm, cfg.trainer.steps))
    return experiment, out_dir, jobs


def order_jobs(jobs: list[Job], by: str = "arm") -> list[Job]:
    """The order runs start in: a run left half-done first (its checkpoint is work already paid for),
    then arm by arm (``arm``: every seed of the first arm, then the next) or seed by seed (``seed``: seed 0
    of every arm, then seed 1). Seed by seed suits a long grid: wherever it stops, every arm has the same
    seeds, so paired comparisons can be read; arm by arm leaves the last arms with none."""
    if by not in ("arm", "seed"):
        raise SystemExit(f"--order {by}: expected arm or seed")
    arms = list(dict.fromkeys(j.arm for j in jobs))
    seeds = list(dict.fromkeys(j.seed for j in jobs))
    position = (lambda j: (arms.index(j.arm), seeds.index(j.seed))) if by == "arm" else \
        (lambda j: (seeds.index(j.seed), arms.index(j.arm)))
    return sorted(jobs, key=lambda j: (j.action != "resume", position(j)))


def _computation(cfg) -> str:
    """A key for what a run computes: its identity (moerl.config.identity_dict) without the arm name."""
    import hashlib
    import json

    from moerl.config import identity_dict

    ident = {k: v for k, v in identity_dict(cfg).items() if k != "arm"}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def warm_start_jobs(jobs: list[Job], out_dir: Path, threads: int, overrides: list[str], python: str = sys.executable,
                    script: str | Path = WARM_START_SCRIPT) -> list[Job]:
    """One scripts/warm_start.py job per uncached warm-start checkpoint the runs need, to run before
    them: concurrent runs sharing a missing checkpoint would otherwise each train it (and race on
    writing it). Arms with the same model/data/warm-start config share one checkpoint."""
    first: dict[str, Job] = {}
    for j in jobs:
        if j.warm_start and j.action != "skip":
            first.setdefault(j.warm_start, j)
    return [Job(j.arm, j.seed, j.config, path, "warm_start",
                str(out_dir / "sweep_logs" / f"warm_start-{Path(path).name}.log"),
                [python, str(script), j.config, f"threads={threads}", *overrides])
            for path, j in first.items()]


class Children:
    """The runs this sweep has started: ended with the sweep, whatever ends it."""

    PR_SET_PDEATHSIG = 1  # linux/prctl.h

    def __init__(self):
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.stopping = False
        try:
            self._prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):  # not Linux: SIGTERM/SIGINT still end the runs
            self._prctl = None

    def __reduce__(self):  # a Ray worker that runs ``execute`` gets a registry of its own
        return Children, ()

    def _die_with_parent(self, parent: int):
        """Runs in the child between fork and exec: SIGKILL when the sweep dies (even by SIGKILL);
        a sweep already gone by then ends the child at once."""
        if self._prctl is None:
            return None

        def arm():
            self._prctl(self.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)

        return arm

    def run(self, command: list[str], **kwargs) -> int:
        """``subprocess.run`` in a new process group that the sweep can end, returning the exit code."""
        with self._lock:
            if self.stopping:
                return -signal.SIGTERM
            proc = subprocess.Popen(command, start_new_session=True,
                                    preexec_fn=self._die_with_parent(os.getpid()), **kwargs)
            self._procs.add(proc)
        try:
            return proc.wait()
        finally:
            with self._lock:
                self._procs.discard(proc)

    def stop(self, grace: float = 10.0) -> int:
        """SIGTERM every run's process group, SIGKILL what is left after ``grace`` seconds; the count."""
        with self._lock:
            self.stopping = True
            procs = list(self._procs)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            deadline = time.monotonic() + grace
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
        return len(procs)


CHILDREN = Children()


def _stop_on_signal(signum, frame):
    stopped = CHILDREN.stop()
    print(f"[sweep] {signal.Signals(signum).name}: stopped {stopped} run(s); run the sweep again to resume them",
          flush=True)
    raise SystemExit(128 + signum)


@contextmanager
def signal_handlers_restored(install=None):
    """Install ``install`` for SIGTERM/SIGINT (if given) for the block, then put back the caller's
    handlers, whatever the block installed (``ray.init`` installs its own SIGTERM handler). A process that
    calls ``main`` in-process (tests, notebooks) and later forks or is terminated must not inherit a
    handler that waits on runs it no longer has: a forked pool worker that catches SIGTERM outlives
    ``Pool.terminate`` and hangs its parent."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for sig in previous if install else ():
            signal.signal(sig, install)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def execute(job: Job, threads: int, cwd: str | Path | None = None) -> Result:
    """Run one job as a subprocess (in ``cwd``, default the current directory: relative paths in the
    configs resolve as they do for the sweep), its stdout and stderr appended to the job's log."""
    Path(job.log).parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(job.log, "a") as fh:
        fh.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {job.action}: {' '.join(job.command)}\n")
        fh.flush()
        rc = CHILDREN.run(job.command, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=job_env(threads))
    return Result(job.arm, job.seed, job.action, rc, time.perf_counter() - start, job.log, job.run_dir)


def run_progress(run_dir: str | Path) -> dict | None:
    """A run's latest training row (step, reward/mean, mismatch/k3), its mean seconds per step and the
    seconds since its metrics.jsonl was last written, read from the file's tail while it trains; None
    before its first step."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        silent = max(0.0, time.time() - path.stat().st_mtime)
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - (1 << 16)))
            tail = fh.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    rows = []
    for line in tail:
        try:
            row = json.loads(line)
        except ValueError:  # the first (cut) line of the tail, or a line being written
            continue
        if isinstance(row, dict) and "step" in row and "reward/mean" in row:
            rows.append(row)
    if not rows:
        return None
    step_times = [r["time/step"] for r in rows if isinstance(r.get("time/step"), (int, float))]
    return {**rows[-1], "seconds_per_step": sum(step_times) / len(step_times) if step_times else None,
            "silent_seconds": silent}


# A run that logs nothing for this many of its own steps (and at least STALL_MIN_SECONDS: an evaluation or
# a checkpoint between two steps takes a while) is named in the heartbeat as possibly stalled: a run stuck
# in one call otherwise shows the same step and ETA for as long as it hangs.
STALL_STEPS, STALL_MIN_SECONDS = 50, 600.0


def stall_note(progress: dict) -> str:
    """'; nothing logged for 25 min (a step takes 3.2 s): stalled?' or ''."""
    per_step, silent = progress.get("seconds_per_step"), progress.get("silent_seconds") or 0.0
    if per_step is None or silent < max(STALL_STEPS * per_step, STALL_MIN_SECONDS):
        return ""
    return f"; nothing logged for {silent / 60:.0f} min (a step takes {per_step:.1f} s): stalled?"


def _clock(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def heartbeat_lines(running: list[Job], total: int, finished: list[Result], n_jobs: int,
                    elapsed: float, blind: bool = False) -> list[str]:
    """One line per running run (step k/N, reward, k3, the run's ETA) and one for the sweep: its ETA
    from the runs finished so far (or, before any, from the running runs' pace). ``blind``: step and ETA
    only, for a registered grid whose verdicts are sealed until its last run lands."""
    now = time.strftime("%H:%M:%S")
    lines, run_etas, run_lengths = [], [], []
    for job in running:
        p = run_progress(job.run_dir)
        if p is None:
            lines.append(f"[sweep {now}] {job.arm} seed{job.seed}: starting (no step logged yet)")
            continue
        left = max(job.steps - int(p["step"]), 0) if job.steps else None
        eta = p["seconds_per_step"] * left if p["seconds_per_step"] is not None and left is not None else None
        run_etas.append(eta or 0.0)
        if p["seconds_per_step"] is not None and job.steps:
            run_lengths.append(p["seconds_per_step"] * job.steps)
        k3 = p.get("mismatch/k3")
        k3 = f"{k3:.2e}" if isinstance(k3, (int, float)) else "-"
        outcome = "" if blind else f"reward {p['reward/mean']:.3f}, k3 {k3}, "
        lines.append(f"[sweep {now}] {job.arm} seed{job.seed}: step {p['step']}/{job.steps or '?'}, "
                     f"{outcome}run ETA {_clock(eta)}{stall_note(p)}")
    # a resumed run's time covers only the steps it had left, so only runs made whole set the pace
    done = [r for r in finished if r.rc == 0 and r.action == "fresh"]
    per_run = (sum(r.seconds for r in done) / len(done)) if done else \
        (sum(run_lengths) / len(run_lengths) if run_lengths else None)
    queued = total - len(finished) - len(running)
    sweep_eta = None if per_run is None else (sum(run_etas) + max(queued, 0) * per_run) / max(1, min(n_jobs, total))
    lines.append(f"[sweep {now}] {len(finished)}/{total} done, {len(running)} running, {max(queued, 0)} queued; "
                 f"{_clock(elapsed)} elapsed, sweep ETA about {_clock(sweep_eta)}")
    return lines


class Heartbeat:
    """Prints heartbeat_lines every ``every`` seconds while a runner works (0: never): a sweep of many
    hours says how far each run is instead of staying silent until a run ends."""

    def __init__(self, every: float, running, total: int, finished: list[Result], n_jobs: int,
                 blind: bool = False):
        self.every, self.running, self.total, self.finished, self.n_jobs = every, running, total, finished, n_jobs
        self.blind = blind
        self.stop = threading.Event()
        self.start = time.perf_counter()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(self.every):
            try:
                lines = heartbeat_lines(self.running(), self.total, list(self.finished), self.n_jobs,
                                        time.perf_counter() - self.start, self.blind)
            except Exception as err:  # noqa: BLE001 - a progress line must never stop the sweep
                lines = [f"[sweep] heartbeat skipped: {type(err).__name__}: {err}"]
            print("\n".join(lines), flush=True)

    def __enter__(self):
        if self.every > 0:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


def _busy(r: Result) -> bool:
    """A run refused because another live process holds it (scripts/run.py exits with BUSY_EXIT_CODE)."""
    from moerl.runlock import BUSY_EXIT_CODE

    return r.rc == BUSY_EXIT_CODE and r.action != "warm_start"


def _report(done: int, total: int, r: Result) -> None:
    status = "ok" if r.rc == 0 else "busy (another process is running it; not run here)" if _busy(r) else \
        f"FAILED (rc {r.rc}, see {r.log})"
    what = f"warm start for {r.arm}" if r.action == "warm_start" else f"{r.arm} seed{r.seed} ({r.action})"
    print(f"[sweep {done}/{total}] {what}: {status} in {r.seconds:.0f} s", flush=True)


def run_local(jobs: list[Job], n_jobs: int, threads: int, heartbeat: float = 0,
              on_result: Callable[[Result], None] | None = None, blind: bool = False) -> list[Result]:
    """Run ``jobs``, ``n_jobs`` at a time; ``on_result`` is called with each result as it lands."""
    results: list[Result] = []
    futures = []
    now_running: dict[str, Job] = {}  # by log path: the runs the heartbeat reports on
    lock = threading.Lock()

    def tracked(job: Job) -> Result:
        with lock:
            now_running[job.log] = job
        try:
            return execute(job, threads)
        finally:
            with lock:
                now_running.pop(job.log, None)

    def running() -> list[Job]:
        with lock:
            return [j for j in now_running.values() if j.action != "warm_start"]

    try:
        with ThreadPoolExecutor(max_workers=max(1, n_jobs)) as pool, \
                Heartbeat(heartbeat, running, len(jobs), results, n_jobs, blind):
            futures = [pool.submit(tracked, j) for j in jobs]
            for fut in as_completed(futures):
                results.append(fut.result())
                _report(len(results), len(jobs), results[-1])
                if on_result is not None:
                    on_result(results[-1])
    finally:  # an error or a signal in the sweep leaves no run behind
        if not all(f.done() for f in futures):
            for f in futures:
                f.cancel()
            CHILDREN.stop()
    return results


def run_ray(jobs: list[Job], threads: int, heartbeat: float = 0,
            on_result: Callable[[Result], None] | None = None, blind: bool = False) -> list[Result]:
    import ray

    address = os.environ.get("RAY_ADDRESS")
    # Without RAY_ADDRESS: a local Ray of this machine's usable cores (no dashboard to serve).
    local = {} if address else {"num_cpus": usable_cores(), "include_dashboard": False}
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, **local)
    module = sys.modules[execute.__module__]
    if module.__name__ != "__main__":  # imported from a file path (tests): workers cannot import it by name
        ray.cloudpickle.register_pickle_by_value(module)
    remote = ray.remote(num_cpus=threads)(execute)
    pending = {remote.remote(j, threads, os.getcwd()): j for j in jobs}
    results: list[Result] = []
    started = time.time()

    def running() -> list[Job]:  # Ray runs them elsewhere: the pending runs whose metrics moved since the start
        out = []
        for j in list(pending.values()):
            metrics = Path(j.run_dir) / "metrics.jsonl"
            if j.action != "warm_start" and metrics.exists() and metrics.stat().st_mtime >= started:
                out.append(j)
        return out

    with Heartbeat(heartbeat, running, len(jobs), results, len(jobs), blind):
        _wait_ray(pending, results, len(jobs), on_result)
    if not address:
        ray.shutdown()
    return results


def _wait_ray(pending: dict, results: list[Result], total: int,
              on_result: Callable[[Result], None] | None = None) -> None:
    import ray

    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        job = pending.pop(ready[0])
        try:
            results.append(ray.get(ready[0]))
        except Exception as err:  # a task that died (node lost, worker killed): report, keep going
            results.append(Result(job.arm, job.seed, job.action, -1, float("nan"), f"{job.log} (ray: {err})",
                                  job.run_dir))
        _report(len(results), total, results[-1])
        if on_result is not None:
            on_result(results[-1])


def run_outcome(run_dir: str) -> dict:
    """What a finished run reached, from its summary.json: steps, reward over the last 10 steps, run-mean
    k3, held-out pass@1 start -> end (empty when the run has no summary)."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    pass1 = [(summary.get(k) or {}).get("eval/pass1") for k in ("initial_eval", "final_eval")]
    return {"steps": summary.get("steps"), "reward": summary.get("reward_last10"),
            "k3": summary.get("mean/mismatch/k3"), "pass1": pass1}


def table(results: list[Result], blind: bool = False) -> str:
    """The summary table a sweep ends with: each run's status and time, and what it reached (``blind``:
    status, time and steps only)."""
    outcome = [] if blind else ["reward (last 10)", "k3 (run mean)", "pass@1 start -> end"]
    header = ["arm", "seed", "action", "status", "seconds", "steps", *outcome]
    lines = [" | ".join(header), " | ".join(["---"] * len(header))]

    def num(value, spec: str) -> str:
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    for r in sorted(results, key=lambda r: (r.action != "warm_start", r.arm, r.seed)):
        status = "skipped (finished)" if r.rc is None else ("ok" if r.rc == 0 else "busy (run by another process)"
                                                              if _busy(r) else f"failed rc={r.rc}")
        if r.rc == -2:
            status = f"not started: its warm start failed ({r.log})"
        o = run_outcome(r.run_dir) if r.run_dir and r.action != "warm_start" else {}
        p0, p1 = o.get("pass1", [None, None])
        cells = [r.arm, "-" if r.action == "warm_start" else str(r.seed), r.action, status, f"{r.seconds:.0f}",
                 str(o.get("steps", "-"))]
        if not blind:
            cells += [num(o.get("reward"), ".3f"), num(o.get("k3"), ".2e"), f"{num(p0, '.3f')} -> {num(p1, '.3f')}"]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


class InvocationRecord:
    """This invocation's entry in sweep.json, written when the sweep starts and again after every run that
    lands, so a sweep stopped from outside (a session's end, a kill) keeps the runs it finished and their
    times; completed with the finished runs it skipped and its wall time when the sweep ends."""

    def __init__(self, out_dir: Path, header: dict):
        self.out_dir, self.start = out_dir, time.perf_counter()
        self.entry = {"id": uuid.uuid4().hex[:16], **header, "wall_seconds": 0.0, "ran": False,
                      "complete": False, "results": []}
        self.problem: RecordError | None = None
        self._write()

    def add(self, result: Result) -> None:
        self.entry["results"].append(asdict(result))
        self.entry["ran"] = True
        self.entry["wall_seconds"] = time.perf_counter() - self.start
        self._write(result)

    def finish(self, skipped: list[Result]) -> Path:
        """The wall time and the skipped runs; an invocation that found every run finished is kept short
        (its runs are listed by the invocations that ran them: a resumed grid's launcher re-visits its
        finished sweeps each time)."""
        self.entry["wall_seconds"] = time.perf_counter() - self.start
        self.entry["complete"] = True
        if self.entry["ran"]:
            self.entry["results"] += [asdict(r) for r in skipped]
        else:
            del self.entry["results"]
            self.entry["all_finished"] = len(skipped)
        self._write()
        if self.problem is not None:  # damaged while the runs ran: this invocation's entry is kept beside it
            aside = self.out_dir / f"sweep.invocation-{self.entry['started'].replace(':', '')}.json"
            aside.write_text(json.dumps(self.entry, indent=1) + "\n")
            raise RecordError(f"{self.problem.code} (this invocation's entry is in {aside})")
        return self.out_dir / "sweep.json"

    def _write(self, result: Result | None = None) -> None:
        if self.problem is not None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # Sweeps of one experiment may run side by side (one per rung): the read-modify-write below holds
        # an exclusive lock so neither loses the other's entry.
        with open(self.out_dir / ".sweep.json.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = read_record(self.out_dir)
            except RecordError as err:
                self.problem = err
                print(f"[sweep] {err.code}; the runs go on, this invocation's entry is written beside it at the end",
                      flush=True)
                return
            invocations = data["invocations"]
            mine = next((i for i, inv in enumerate(invocations) if inv.get("id") == self.entry["id"]), None)
            if mine is None:
                invocations.append(self.entry)
            else:
                invocations[mine] = self.entry
            data["total_wall_seconds"] = sum(i["wall_seconds"] for i in invocations if i["ran"])
            # a run refused as busy is another process's attempt: neither its time nor an attempt is its run's
            if result is not None and result.rc is not None and result.action != "warm_start" and not _busy(result):
                slot = data.setdefault("runs", {}).setdefault(f"{result.arm}/seed{result.seed}",
                                                              {"seconds": 0.0, "attempts": 0})
                slot["seconds"] += result.seconds if result.seconds == result.seconds else 0.0
                slot["attempts"] += 1
                slot["rc"] = result.rc
            path = self.out_dir / "sweep.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(data, indent=1) + "\n")
            tmp.replace(path)


class RecordError(SystemExit):
    """sweep.json cannot be read as a sweep record; the message names it and what to do."""


def read_record(out_dir: Path) -> dict:
    """sweep.json's content (an empty record when absent), or a RecordError naming the file: checked
    before any run starts, so a damaged record is not found only after hours of runs."""
    path = out_dir / "sweep.json"
    if not path.exists():
        return {"invocations": []}
    try:
        data = json.loads(path.read_text())
        problem = None if isinstance(data, dict) and isinstance(data.get("invocations"), list) \
            else "expected an object with an 'invocations' list"
    except (ValueError, OSError) as err:
        problem = " ".join(str(err).split())
    if problem:
        raise RecordError(f"{path}: not a readable sweep record ({problem}); move it aside (the runs' own "
                          f"directories hold their results) and run the sweep again")
    return data


def main(argv: list[str] | None = None) -> int:
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    if debug:
        return sweep(argv)
    try:
        return sweep(argv)
    except SystemExit:
        raise
    except Exception as err:  # noqa: BLE001 - one actionable line; --debug shows the traceback
        raise SystemExit(f"sweep error: {type(err).__name__}: {' '.join(str(err).split())} "
                         f"(--debug shows the traceback)") from None


def sweep(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment_dir", help="e.g. experiments/00_tiny_moe_cpu (arms in <dir>/arms/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides passed to every run")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    ap.add_argument("--seed-list", default=None, help="explicit seeds, comma-separated (instead of --seeds)")
    ap.add_argument("--arms", default=None, help="comma-separated subset of arms (default: all)")
    ap.add_argument("--order", choices=("arm", "seed"), default="arm",
                    help="start runs arm by arm (default) or seed by seed (seed 0 of every arm first: a grid "
                         "stopped early still pairs every arm); an interrupted run resumes first either way")
    ap.add_argument("--jobs", type=int, default=None, help="runs at a time (default: the number of cores)")
    ap.add_argument("--threads", type=int, default=None, help="threads per run (default max(1, cores // jobs))")
    ap.add_argument("--output-dir", default=None, help="tracking.output_dir for every run (default: the config's, runs/)")
    ap.add_argument("--ray", action="store_true", help="run as Ray tasks (RAY_ADDRESS, or a local Ray)")
    ap.add_argument("--run-script", default=str(RUN_SCRIPT), help=argparse.SUPPRESS)  # tests: a stand-in run.py
    ap.add_argument("--warm-start-script", default=str(WARM_START_SCRIPT), help=argparse.SUPPRESS)
    ap.add_argument("--heartbeat", type=float, default=60,
                    help="seconds between progress lines (step, reward, k3, ETA of each running run); 0: none")
    ap.add_argument("--blind", action="store_true",
                    help="a registered grid whose verdicts are sealed until its last run lands: progress lines "
                         "and the closing table show steps and times, never reward, k3 or pass@1")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    ap.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    args = ap.parse_intermixed_args(argv)

    if args.seed_list:
        try:
            seeds = [int(s) for s in args.seed_list.split(",") if s.strip()]
        except ValueError:
            raise SystemExit(f"--seed-list {args.seed_list}: expected comma-separated integers, e.g. 0,1,2") from None
    else:
        seeds = list(range(args.seeds))
    if not seeds or any(s < 0 for s in seeds):
        given = f"--seed-list {args.seed_list}" if args.seed_list else f"--seeds {args.seeds}"
        raise SystemExit(f"{given}: expected at least one seed, none negative (--seeds N runs seeds 0..N-1)")
    overrides = list(args.overrides) + ([f"tracking.output_dir={args.output_dir}"] if args.output_dir else [])
    cores = usable_cores()
    n_jobs = args.jobs or cores
    threads = args.threads or threads_per_job(cores, n_jobs)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    experiment, out_dir, jobs = plan(Path(args.experiment_dir), seeds, arms, overrides, threads,
                                     run_script=args.run_script)
    jobs = order_jobs(jobs, args.order)
    read_record(out_dir)  # a damaged sweep.json stops the sweep now, not after its runs
    todo = [j for j in jobs if j.action != "skip"]
    n_warm = len({j.warm_start for j in todo if j.warm_start})
    warm_threads = args.threads or threads_per_job(cores, min(n_jobs, max(n_warm, 1)))
    warm = warm_start_jobs(todo, out_dir, warm_threads, overrides, script=args.warm_start_script)
    print(f"[sweep] {experiment}: {len(jobs)} runs ({len(jobs) - len(todo)} finished, "
          f"{sum(j.action == 'resume' for j in todo)} to resume, {sum(j.action == 'fresh' for j in todo)} to start); "
          f"{'ray' if args.ray else f'{n_jobs} at a time'}, {threads} thread(s) each, {cores} cores", flush=True)
    if warm:
        print(f"[sweep] {len(warm)} warm-start checkpoint(s) to train first: {[j.run_dir for j in warm]}")
    if args.dry_run:
        for j in warm + jobs:
            print(f"{j.arm} seed{j.seed}: {j.action}" + (f"  $ {' '.join(j.command)}" if j.command else ""))
        return 0

    from moerl.tracking import git_sha

    start, started_at = time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%S")
    record = InvocationRecord(out_dir, {"started": started_at, "jobs": n_jobs, "threads_per_job": threads,
                                        "cores": cores, "ray": args.ray, "git_sha": git_sha(), "seeds": seeds,
                                        "overrides": overrides})
    runner = (lambda js, t: run_ray(js, t, args.heartbeat, record.add, args.blind)) if args.ray else \
        (lambda js, t: run_local(js, n_jobs, t, args.heartbeat, record.add, args.blind))
    # SIGTERM/SIGINT stop the runs, resumable (under Ray, Ray owns the processes of its tasks)
    with signal_handlers_restored(None if args.ray else _stop_on_signal):
        ran = runner(warm, warm_threads) if warm else []
        failed_logs = {r.log for r in ran if r.rc != 0}
        broken = {j.run_dir: j.log for j in warm if j.log in failed_logs}
        # Runs whose warm start failed are not started (each would retry it): reported as failed.
        not_started = [Result(j.arm, j.seed, j.action, -2, 0.0, broken[j.warm_start], j.run_dir)
                       for j in todo if j.warm_start in broken]
        for r in not_started:
            record.add(r)
        ran += not_started
        todo = [j for j in todo if j.warm_start not in broken]
        ran += runner(todo, threads) if todo else []
    wall = time.perf_counter() - start
    skipped = [Result(j.arm, j.seed, "skip", None, 0.0, j.log, j.run_dir) for j in jobs if j.action == "skip"]
    results = ran + skipped
    path = record.finish(skipped)
    print(table(results, args.blind))
    failed = [r for r in results if r.rc not in (None, 0) and not _busy(r)]
    busy = sum(_busy(r) for r in results)
    print(f"[sweep] {len(ran)} run(s) in {wall:.0f} s wall; {len(failed)} failed"
          f"{f'; {busy} busy (run by another process)' if busy else ''}; recorded in {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
