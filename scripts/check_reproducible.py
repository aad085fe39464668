"""Does an arm reproduce its recorded run on this machine? Bit for bit on the CPU kind that recorded it,
statistically on another kind.

    python scripts/check_reproducible.py [--arm fp32_rollout] [--seed 0] [--steps 10]
                                         [--recorded results/runs] [--experiment experiments/00_tiny_moe_cpu]
                                         [--check auto|bitwise|statistical] [--bitwise]

Re-runs the arm's first ``--steps`` GRPO steps (0 = the whole run) into a temporary directory, then applies
one of two checks and says which:

- **bitwise**, when the re-run ran on the CPU kind that recorded the run (same CPU model, ISA flags, torch
  CPU capability and oneDNN ISA cap in both ``machine.json`` records): every logged value of every
  recorded row up to that step is compared with the recorded run (JSON floats round-trip exactly), except
  wall-clock times. The trajectory -- what the sampled tokens decide: rewards, held-out accuracy, response
  lengths, routing, refit sizes -- must match bit for bit; float statistics of logprobs and gradients are
  reported with their largest relative difference, and must match too with --bitwise.
- **statistical**, on another CPU kind (or a recording without a machine record): the emulated bf16
  kernels round at the same points to the same formats on every CPU, but the fp32 products they round
  come from the CPU's own GEMM, so the trajectory departs within a few steps while its statistics stay the
  same. The re-run's median k3, reward over each half of the steps, held-out pass@1 and share of tokens
  routed alike must each lie in the 99% prediction interval of the arm's recorded seeds (the rule is
  written out in ``moerl.analysis.reproduction``).

``--check`` forces one of the two. The re-run uses the recorded run's thread count (in fp32 it sets the
reduction order, so it is part of what is reproduced). Exits 0 when the applicable check passes, 1 when it
fails (naming the first differing step and key, or the quantities outside their interval), 2 when it
cannot judge.

    python scripts/check_reproducible.py --arm baseline --steps 0 --run results/reproduce/00_tiny_moe_cpu/baseline/seed0

``--run`` compares a run that already exists (``scripts/reproduce.sh`` does this for each of its arms) instead
of re-running; a run made with another thread count than the recorded one is expected to differ bitwise, and
the report says so.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from moerl.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]


def _kind(row: dict) -> str:
    return "train" if "reward/mean" in row else "eval"


# What the run *did*: the tokens it sampled decide these, so they must match exactly. The other
# values are float statistics of logprobs and gradients.
TRAJECTORY = ("reward/", "eval/", "response/", "routing/", "replay/", "updates/", "refit/bytes", "refit/buckets",
              "refit/tensors", "refit/version", "lr", "mismatch/tokens", "mismatch/seqs")
WALL_CLOCK = ("time/", "refit/seconds")


def is_trajectory(key: str) -> bool:
    return key.startswith(TRAJECTORY)


def compare(recorded: list[dict], fresh: list[dict], max_step: int | None = None) -> list[str]:
    """Differences between two runs' metric rows, as lines 'step S (kind): key recorded X, now Y'.
    Rows are matched by (step, train|eval); every key of a recorded row must be logged again with the
    same value (wall-clock times excepted); keys that only the new run logs are not differences. A key
    recorded under a name since changed (moerl.analysis.results.METRIC_ALIASES) is compared under its current name."""
    from moerl.analysis.results import canonical_key

    def index(rows):
        return {(int(r["step"]), _kind(r)): {canonical_key(k): v for k, v in r.items()} for r in rows
                if max_step is None or int(r["step"]) <= max_step}
    old, new = index(recorded), index(fresh)
    out = []
    for key in sorted(old):
        if key not in new:
            out.append(f"step {key[0]} ({key[1]}): recorded, not logged by the re-run")
            continue
        for name, value in old[key].items():
            if name.startswith(WALL_CLOCK):
                continue
            if name not in new[key]:
                out.append(f"step {key[0]} ({key[1]}): '{name}' recorded as {value!r}, not logged by the re-run")
            elif new[key][name] != value:
                out.append(f"step {key[0]} ({key[1]}): '{name}' recorded {value!r}, now {new[key][name]!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", default="fp32_rollout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10, help="GRPO steps to re-run and compare (0 = all)")
    ap.add_argument("--recorded", default=str(REPO / "results" / "runs"))
    ap.add_argument("--experiment", default=str(REPO / "experiments" / "00_tiny_moe_cpu"))
    ap.add_argument("--run", default=None,
                    help="compare this existing run directory with the recorded one instead of re-running")
    ap.add_argument("--bitwise", action="store_true",
                    help="in the bitwise check, fail on any difference, float statistics included")
    ap.add_argument("--check", choices=("auto", "bitwise", "statistical"), default="auto",
                    help="auto (default): bitwise on the CPU kind that recorded the run, statistical on another")
    args = ap.parse_args(argv)
    experiment = Path(args.experiment)
    from moerl.analysis.results import run_names

    runs = [Path(args.recorded) / experiment.name / name / f"seed{args.seed}"
            for name in run_names(args.arm, experiment.name)]
    run = next((r for r in runs if r.exists()), runs[0])
    recorded = read_metrics(run / "metrics.jsonl")
    if not recorded:
        sys.exit(f"check_reproducible: no recorded run at {run} (expected metrics.jsonl)")
    # A run named <arm>+key-value+... (recorded before: <arm>+key=value,...) was made from the arm's
    # file with those overrides.
    # An arm's former name (moerl.config.RENAMED_ARMS) runs its current file, under its current name.
    from moerl.config import arm_file, current_arm, legacy_run_label

    arm, _, named = legacy_run_label(current_arm(experiment.name, args.arm)).partition("+")
    name_overrides = [o for o in named.split(",") if o]
    arm_yaml = arm_file(experiment / "arms" / f"{arm}.yaml")
    if not arm_yaml.exists():
        sys.exit(f"check_reproducible: no arm config {arm_yaml}")
    recorded_cfg = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").exists() else {}
    # fp32 results depend on the thread count (it sets the reduction order): re-run with the recorded one.
    threads = recorded_cfg.get("threads")
    if args.run:
        fresh = read_metrics(Path(args.run) / "metrics.jsonl")
        if not fresh:
            sys.exit(f"check_reproducible: no run at {args.run} (expected metrics.jsonl)")
        run_cfg = yaml.safe_load((Path(args.run) / "config.yaml").read_text()) if (Path(args.run) / "config.yaml").exists() else {}
        ran_with = run_cfg.get("threads") or _threads_of(Path(args.run))
        if threads and ran_with and int(ran_with) != int(threads):
            print(f"note: {args.run} ran on {ran_with} thread(s), the recorded run on {threads}: in fp32 the thread "
                  "count sets the reduction order, so the two are expected to differ", flush=True)
        return decide(recorded, fresh, run, Path(args.run), args)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"tracking.output_dir={tmp}", "tracking.wandb_mode=disabled", "tracking.progress_bar=false",
                     *name_overrides, *recorded_settings(recorded_cfg)]
        if threads:
            overrides.append(f"threads={threads}")
        if args.steps:
            overrides.append(f"trainer.steps={args.steps}")
        cmd = [sys.executable, str(REPO / "scripts" / "run.py"), str(arm_yaml), "--seed", str(args.seed),
               "--no-progress", *overrides]
        print("re-running:", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"check_reproducible: the re-run failed:\n{proc.stderr[-3000:]}")
        fresh_files = list(Path(tmp).glob(f"**/{arm}*/seed{args.seed}/metrics.jsonl"))
        if not fresh_files:
            sys.exit(f"check_reproducible: the re-run wrote no metrics.jsonl under {tmp}")
        fresh = read_metrics(fresh_files[0])
        return decide(recorded, fresh, run, fresh_files[0].parent, args)


def decide(recorded: list[dict], fresh: list[dict], run: Path, fresh_dir: Path, args) -> int:
    """Apply the check that fits (bitwise on the recording's CPU kind, statistical on another), saying
    which and why; return the exit code."""
    from moerl.analysis.reproduction import kind_difference, read_machine

    differences = kind_difference(read_machine(run), read_machine(fresh_dir))
    check = args.check
    if check == "auto":
        check = "statistical" if differences else "bitwise"
    why = ("same CPU kind as the recording" if not differences
           else "another CPU kind than the recording (" + "; ".join(differences) + ")")
    print(f"check applied: {check} ({why}{'' if args.check == 'auto' else ', chosen by --check'})", flush=True)
    if check == "bitwise":
        return report(recorded, fresh, run, args.steps, args.bitwise)
    return report_statistical(recorded, fresh, run, args.steps)


def report_statistical(recorded: list[dict], fresh: list[dict], run: Path, steps: int) -> int:
    """The re-run's summary against the recorded seeds' 99% prediction intervals; the exit code. Where the
    trajectory first departs from the recorded run is reported too (not judged)."""
    from moerl.analysis.reproduction import PREDICTION_LEVEL, judge

    diffs = compare(recorded, fresh, max_step=steps or None)
    departs = [d for d in diffs if "'" not in d or is_trajectory(d.split("'")[1])]
    departs.sort(key=lambda d: int(d.split()[1]))
    print("not judged, for information: " + (f"the trajectory departs from {run} at {departs[0]}" if departs
          else f"the trajectory repeats {run} bit for bit" + ("" if not diffs else
               f"; {len(diffs)} float statistic(s) differ in their last bits")), flush=True)

    seed_dirs = sorted(p for p in run.parent.glob("seed*") if (p / "metrics.jsonl").exists())
    seeds = [read_metrics(p / "metrics.jsonl") for p in seed_dirs]
    judged = judge(fresh, seeds, max_step=steps or None)
    print(f"against {len(seeds)} recorded seed(s) of {run.parent} ({PREDICTION_LEVEL:.0%} prediction interval of "
          f"a further seed, over steps {'1..' + str(steps) if steps else 'all'}):")
    print("  " + "\n  ".join(j.line() for j in judged))
    tested = [j for j in judged if j.passed is not None]
    if not tested:
        print(f"CANNOT JUDGE statistically: fewer than two recorded seeds under {run.parent}, or no quantity logged")
        return 2
    failed = [j.quantity for j in tested if not j.passed]
    if failed:
        print(f"NOT reproduced statistically: {', '.join(failed)} outside the recorded seeds' spread")
        return 1
    print(f"reproduced statistically: all {len(tested)} judged quantities inside the recorded seeds' spread "
          "(bitwise equality is not expected on another CPU kind)")
    return 0


def _threads_of(run: Path) -> int | None:
    """The threads a run's process used, from its machine.json (a config with ``threads: null`` took them from
    $OMP_NUM_THREADS or the cores)."""
    import json

    try:
        return json.loads((run / "machine.json").read_text()).get("torch_threads")
    except (FileNotFoundError, ValueError):
        return None


def report(recorded: list[dict], fresh: list[dict], run: Path, steps: int, bitwise: bool) -> int:
    """Print whether ``fresh`` reproduces the recorded run (the trajectory, then the float statistics) and
    return the exit code."""
    diffs = compare(recorded, fresh, max_step=steps or None)
    compared = sum(1 for r in recorded if not steps or int(r["step"]) <= steps)
    path_diffs = [d for d in diffs if is_trajectory(d.split("'")[1] if "'" in d else "")]
    path_diffs += [d for d in diffs if "'" not in d]  # a missing row
    if not diffs:
        print(f"reproduced bit for bit: {compared} recorded rows of {run} (every value except wall-clock times)")
        return 0
    stats = float_deviation(recorded, fresh, steps or None)
    if path_diffs or bitwise:
        what = "the trajectory differs" if path_diffs else "float statistics differ (--bitwise)"
        print(f"NOT reproduced ({what}): {len(diffs)} difference(s) in {compared} recorded rows of {run}; first:")
        print("  " + "\n  ".join((path_diffs or diffs)[:10]))
        return 1
    print(f"trajectory reproduced bit for bit: {compared} recorded rows of {run} (rewards, held-out accuracy, "
          f"response lengths, routing, refit sizes); float statistics of logprobs and gradients differ in "
          f"their last bits on this machine (kernels or thread partition differ from the recording machine): "
          f"largest relative difference {stats[0]:.2g} ('{stats[1]}'); mismatch and IS statistics (round-off between two fp32 policies) differ by at most "
          f"{stats[2]:.2g} ('{stats[3]}')")
    return 0


def recorded_settings(recorded_cfg: dict) -> list[str]:
    """Overrides that pin the keys added since runs were first recorded (moerl.config.LEGACY_VALUES) to
    what the recorded run used: its value where its config.yaml has the key, the legacy value where it
    predates the key. A changed default never makes an old run look irreproducible."""
    from moerl.config import LEGACY_VALUES, flatten

    flat = flatten(recorded_cfg)
    return [f"{key}={flat.get(key, legacy)}" for key, legacy in LEGACY_VALUES.items()]


def float_deviation(recorded: list[dict], fresh: list[dict], max_step: int | None) -> tuple[float, str, float, str]:
    """(largest relative difference, its key) over losses, gradient norms and entropies, and (largest
    absolute difference, its key) over the mismatch and importance-weight statistics: between an fp32
    engine and an fp32 trainer those measure round-off (k3 ~ 1e-13), so only their size means anything."""
    new = {(int(r["step"]), _kind(r)): r for r in fresh}
    worst, worst_abs = (0.0, ""), (0.0, "")
    for row in recorded:
        key = (int(row["step"]), _kind(row))
        if (max_step is not None and key[0] > max_step) or key not in new:
            continue
        for name, value in row.items():
            other = new[key].get(name)
            if name.startswith(WALL_CLOCK) or is_trajectory(name) or not isinstance(value, (int, float)) \
                    or not isinstance(other, (int, float)) or value == other:
                continue
            if not name.startswith(("mismatch/", "is/", "ratio/")) and value != 0:
                worst = max(worst, (abs(other - value) / abs(value), name))
            else:
                worst_abs = max(worst_abs, (abs(other - value), name))
    return (*worst, *worst_abs)


if __name__ == "__main__":
    sys.exit(main())
