"""Run one arm of an experiment (embedded path): warm start (cached), then LoRA GRPO.

    python scripts/run.py experiments/00_tiny_moe_cpu/arms/baseline.yaml [--seed 1] [--resume | --fresh]
                          [--unless-started] [--unverified-checkpoint] [--print-config] [--debug] [key=value ...]

The run directory is <tracking.output_dir>/<experiment>/<arm>[+<overrides>]/seed<k> (default
output: runs/, which git ignores; the recorded ablation in results/runs is never written to unless
asked for). Overrides that change what the run computes are part of its name, so they never land
in another run's directory. An existing run is never overwritten: continue it with --resume (only
with the config it was started with), or move it aside with --fresh (renamed, not deleted). One
process at a time writes a run directory: a second run or resume of a live one is refused, naming
the live process (a lock on ``.seed<k>.lock`` beside the run and on the run directory itself,
released when its process ends). A resume verifies what it continues: every checkpoint's manifest
(checksums, config hash, the base weights' content hash) and the metrics rows up to the checkpoint.

Errors are one line naming the file, key or run and what to do; --debug shows the traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="an arm YAML, e.g. experiments/00_tiny_moe_cpu/arms/baseline.yaml")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    ap.add_argument("--fresh", action="store_true", help="rename an existing run directory aside and start over")
    ap.add_argument("--unless-started", action="store_true",
                    help="with --fresh: leave a run that is finished or checkpointed as it is (finished: nothing to "
                         "do; checkpointed: continue it as --resume does); decided under the run's lock, so a "
                         "sweep's plan made before another process got to the run cannot move it aside")
    ap.add_argument("--unverified-checkpoint", action="store_true",
                    help="with --resume: load a checkpoint that has no manifest.json, unchecked")
    ap.add_argument("--print-config", action="store_true",
                    help="print the resolved config and its run directory, then exit")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    return ap.parse_intermixed_args(argv)  # options may follow the overrides


def run(args) -> dict | None:
    from moerl.config import config_hash, config_yaml, load_config

    if args.resume and args.fresh:
        raise UsageError("--resume and --fresh contradict each other: --resume continues the run, "
                         "--fresh moves it aside and starts over; pass one")
    if args.unless_started and not args.fresh:
        raise UsageError("--unless-started qualifies --fresh; pass it with --fresh")
    overrides = list(args.overrides) + ([f"seed={args.seed}"] if args.seed is not None else [])
    cfg = load_config(args.config, overrides)
    run_dir = cfg.run_dir
    if args.print_config:
        # the model keys the family never reads are left out (they are refused when set)
        print(f"# run directory: {run_dir}\n# config hash: {config_hash(cfg)}\n{config_yaml(cfg, only_read=True)}",
              end="")
        return None
    from moerl.runlock import lock_run
    from moerl.trainer.grpo import check_splits

    check_splits(cfg)  # bad data fails before anything is written (the lock file included)
    if args.resume and not run_dir.is_dir():  # refused before the lock: no empty folders, no lock file left
        out = cfg.tracking.output_dir
        where = "" if Path(out).is_absolute() else \
            f"; tracking.output_dir={out} is relative, taken from the working directory {Path.cwd()}"
        raise UsageError(f"{run_dir}: no such run to resume (its name carries the overrides that change it{where}); "
                         f"start it without --resume")
    # One writer per run directory, taken before the run's state is looked at: a second run or a
    # resume of a live run is refused, naming the process that holds it.
    lock_run(run_dir)
    if args.unless_started and run_dir.is_dir():
        from moerl.trainer.checkpoint import checkpoint_dirs

        if (run_dir / "summary.json").exists() or checkpoint_dirs(run_dir):
            finished = (run_dir / "summary.json").exists()
            print(f"{run_dir} was {'finished' if finished else 'checkpointed'} by another process after this run "
                  f"was planned: {'nothing to do' if finished else 'continuing it (--resume)'}, nothing moved aside",
                  flush=True)
            args.fresh, args.resume = False, not finished
    if (run_dir / "summary.json").exists() and not args.fresh:
        from moerl.identity import inputs_record
        from moerl.tracking import check_same_config, check_same_inputs

        check_same_config(run_dir, cfg, "skip")
        check_same_inputs(run_dir, inputs_record(cfg), "skip")  # its data files, by content
        print(f"{run_dir} is finished (summary.json): nothing to do (--fresh moves it aside and starts over)")
        return json.loads((run_dir / "summary.json").read_text())
    if run_dir.exists() and any(run_dir.iterdir()) and not args.resume:
        if not args.fresh:
            raise UsageError(f"{run_dir} already holds a run: pass --resume to continue it or --fresh to move it aside")
        aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        print(f"moved the previous run to {aside}")

    from moerl.trainer.grpo import GRPOTrainer

    print(f"{'resuming' if args.resume else 'writing'} {run_dir} (config hash {config_hash(cfg)})", flush=True)
    trainer = GRPOTrainer(cfg, run_dir, resume=args.resume, progress=not args.no_progress,
                          unverified_checkpoint=args.unverified_checkpoint)
    sync_dir = trainer.tracker.wandb_sync_dir
    summary = trainer.train()
    print(json.dumps({k: summary[k] for k in ("run", "steps", "warm_start_accuracy", "initial_eval", "final_eval",
                                             "reward_first10", "reward_last10")}, indent=2))
    print(f"run directory: {run_dir}")
    if sync_dir is not None:
        from moerl.tracking import wandb_sync_command

        # every directory of a resumed run into its one wandb run
        command = wandb_sync_command(run_dir) or f"wandb sync {shlex.quote(str(sync_dir))}"
        print(f"wandb (offline): upload with `{command}`")
    return summary


class UsageError(Exception):
    """Contradictory or impossible command-line requests."""


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.debug:
        return run(args)
    from moerl.runlock import RunLockedError

    try:
        return run(args)
    except KeyboardInterrupt:
        sys.exit("interrupted; continue with --resume")
    except RunLockedError as err:  # the run is live in another process: busy, not failed
        raise Busy(one_line_error(err)) from None
    except Exception as err:  # noqa: BLE001 - one actionable line for the user; --debug for the traceback
        sys.exit(one_line_error(err))


class Busy(SystemExit):
    """The run is refused because another live process holds it; the script exits with BUSY_EXIT_CODE."""


def one_line_error(err: BaseException) -> str:
    from moerl.config import ConfigError

    kind = "config error" if isinstance(err, ConfigError) else "error"
    text = " ".join(str(err).split()) or type(err).__name__
    if not isinstance(err, (ConfigError, UsageError)) and type(err).__module__.split(".")[0] != "moerl":
        text = f"{type(err).__name__}: {text}"
    return f"{kind}: {text} (--debug shows the traceback)"


if __name__ == "__main__":
    try:
        main()
    except Busy as busy:
        print(busy.code, file=sys.stderr)
        from moerl.runlock import BUSY_EXIT_CODE

        sys.exit(BUSY_EXIT_CODE)
