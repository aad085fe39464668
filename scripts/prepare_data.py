"""Write the verl parquet files the scale experiments read (data.train_files / val_files).

    python scripts/prepare_data.py --task math --train data/raw/math_train.jsonl --test data/raw/math_test.jsonl
    python scripts/prepare_data.py --task gsm8k --hub openai/gsm8k          # needs network
    python scripts/prepare_data.py --task arith                              # offline synthetic fallback

Output: <out>/<name>/train.parquet and test.parquet in verl's RL schema (data_source, prompt,
ability, reward_model.ground_truth, extra_info), via moerl.data.verl_format.write_verl_parquet.
The experiments read ``${MOERL_DATA_DIR:-data/verl}/math/``, so ``--name math`` is the default.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moerl.config import DataConfig
from moerl.data import load_splits
from moerl.data.verl_format import write_verl_parquet


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["math", "gsm8k", "arith"], default="math")
    ap.add_argument("--train", help="local .parquet/.jsonl/.json with question/problem + answer/solution")
    ap.add_argument("--test", help="local test file (optional)")
    ap.add_argument("--hub", help="hub dataset id, e.g. openai/gsm8k (needs network)")
    ap.add_argument("--train-size", type=int, default=1_000_000)
    ap.add_argument("--test-size", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="data/verl")
    ap.add_argument("--name", default="math", help="sub-folder; experiments read <out>/math")
    args = ap.parse_args(argv)
    if args.task != "arith" and not (args.train or args.hub):
        print(f"error: --task {args.task} needs --train (local file) or --hub (online); "
              f"use --task arith for the offline synthetic task", file=sys.stderr)
        return 2
    cfg = DataConfig(task=args.task, train_path=args.train, test_path=args.test, hub_id=args.hub,
                     train_size=args.train_size, test_size=args.test_size, seed=args.seed)
    try:
        train, test = load_splits(cfg)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not train:
        print(f"error: no usable training rows from {args.train or args.hub}", file=sys.stderr)
        return 2
    out = Path(args.out) / args.name
    paths = [write_verl_parquet(train, args.task, "train", out / "train.parquet")]
    if test:
        paths.append(write_verl_parquet(test, args.task, "test", out / "test.parquet"))
    for p, rows in zip(paths, (train, test)):
        print(f"wrote {p} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
