"""Run one arm of an experiment (embedded path): warm start (cached), then LoRA GRPO.

    python scripts/run.py experiments/00_tiny_moe_cpu/arms/baseline.yaml [--seed 1] [--resume] [key=value ...]

The run directory is <tracking.output_dir>/<experiment>/<arm>/seed<k>. An existing run is never
overwritten: continue it with --resume, or move it aside with --fresh (renamed, not deleted).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from moerl.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="an arm YAML, e.g. experiments/00_tiny_moe_cpu/arms/baseline.yaml")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    ap.add_argument("--fresh", action="store_true", help="rename an existing run directory aside and start over")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_intermixed_args(argv)  # options may follow the overrides
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides) + ([f"seed={args.seed}"] if args.seed is not None else [])
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        sys.exit(f"config error: {err}")
    run_dir = Path(cfg.tracking.output_dir) / cfg.experiment / cfg.arm / f"seed{cfg.seed}"
    if run_dir.exists() and any(run_dir.iterdir()) and not args.resume:
        if not args.fresh:
            sys.exit(f"{run_dir} already holds a run: pass --resume to continue it or --fresh to move it aside")
        aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        print(f"moved the previous run to {aside}")

    from moerl.trainer.grpo import GRPOTrainer

    trainer = GRPOTrainer(cfg, run_dir, resume=args.resume, progress=not args.no_progress)
    summary = trainer.train()
    print(json.dumps({k: summary[k] for k in ("run", "steps", "warm_start_accuracy", "initial_eval", "final_eval",
                                             "reward_first10", "reward_last10")}, indent=2))
    return summary


if __name__ == "__main__":
    main()
