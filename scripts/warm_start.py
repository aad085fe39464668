"""Train (or retrain) the cached warm-start checkpoint for an experiment config.

    python scripts/warm_start.py experiments/00_tiny_moe_cpu/base.yaml [--force] [key=value ...]
"""
from __future__ import annotations

import argparse
import logging
import shutil

import torch

from moerl.config import load_config, resolved_threads
from moerl.trainer.warm_start import train_warm_start, warm_start_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--force", action="store_true", help="retrain even if a cached checkpoint exists")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(resolved_threads(cfg))
    path = warm_start_dir(cfg)
    if (path / "meta.json").exists() and not args.force:
        print(f"cached warm start exists: {path} (use --force to retrain)")
        return
    if args.force:
        shutil.rmtree(path, ignore_errors=True)
    meta = train_warm_start(cfg, path)
    print(f"saved {path}: {meta['test_accuracy']} in {meta['train_seconds']} s")


if __name__ == "__main__":
    main()
