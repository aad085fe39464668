"""Write a tiny checkpoint directory of one MoE family in the hub's format (safetensors with the hub's tensor
names, a byte-level BPE tokenizer trained here, chat template, padded vocabulary), and optionally GSM8K-shaped
data beside it: what experiment 08's --smoke and the tests run the real-checkpoint path on.

    python scripts/write_checkpoint_double.py olmoe runs/doubles/olmoe [--data runs/doubles/gsm8k]
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from moerl.models.families import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=sorted(FAMILIES))
    ap.add_argument("out", help="the checkpoint directory to write")
    ap.add_argument("--data", help="also write DIR/train.jsonl (raw GSM8K columns) and DIR/test.parquet (verl's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from moerl.models.doubles import write_double, write_gsm8k_file

    path = write_double(args.family, args.out, seed=args.seed)
    print(f"wrote {path} ({args.family})")
    if args.data:
        train = write_gsm8k_file(f"{args.data}/train.jsonl", 256, seed=args.seed)
        test = write_gsm8k_file(f"{args.data}/test.parquet", 32, seed=args.seed + 1, verl_format=True)
        print(f"wrote {train} and {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
