"""Check a run's first steps against the invariants every healthy GRPO run meets; exit 1 naming each
one that fails.

    python scripts/check_first_steps.py RUN [--experiment experiments/04_moonlight_16b_a3b_r3] [--r3]
                                        [--refit-log LOG] [--expert-bias-log EB] [--checkpoint CKPT --ep N]
    RUN: a moerl run directory, a verl file-logger .jsonl, a verl console log, or wandb:ENTITY/PROJECT/RUN_ID
    LOG: the run's refit side log (moerl.verl_ext.refit_log; the launcher prints its path); found by itself
         as X.refit.jsonl beside a run log X.jsonl. It decides the refit at any learning rate.
    EB: the trainer's expert-bias side log (moerl.verl_ext.expert_bias_log); found by itself as
        X.expert_bias.jsonl beside the refit side log. Fails a run whose router expert bias moved.
    CKPT: the trainer's checkpoint of the adapter (Megatron torch_dist / DCP directory, .pt or .safetensors)

The invariants, their reasons and the bf16 floors: moerl.verl_ext.first_steps; the checkpoint's:
moerl.verl_ext.checkpoint_check.
"""
from __future__ import annotations

import argparse
import sys

from moerl.verl_ext import first_steps as fs


def main(argv: list[str] | None = None, api=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--experiment", help="scale experiment directory or arm YAML: gives the family and R3 mode")
    ap.add_argument("--family", help=f"model family for the bf16 floor ({', '.join(sorted(fs.BF16_K3_FLOOR))})")
    ap.add_argument("--r3", action="store_true", help="the run uses R3 (auto for moerl runs and --experiment)")
    ap.add_argument("--floor", type=float, help="override the family's step-1 k3 floor (say why in the run notes)")
    ap.add_argument("--r3-unlogged-ok", action="store_true",
                    help="accept an R3 run that logs no replay agreement (verl 0.9.1); prints that R3 was not checked")
    ap.add_argument("--refit-undecided-ok", action="store_true",
                    help="accept a run whose log cannot decide the refit (no refit/version, updates too small); "
                         "prints that the refit was not checked")
    ap.add_argument("--refit-log", help="the run's refit side log (default: RUN's X.refit.jsonl beside X.jsonl, "
                                        "if it exists); decides the refit at any learning rate")
    ap.add_argument("--expert-bias-log", help="the trainer's expert-bias side log (default: X.expert_bias.jsonl "
                                              "beside the refit side log, if it exists)")
    ap.add_argument("--checkpoint", help="also check the trainer checkpoint's shared expert adapter across EP ranks")
    ap.add_argument("--ep", type=int, help="expert-parallel size of that checkpoint (names the drifted EP ranks)")
    args = ap.parse_args(argv)
    try:
        fam, r3 = fs.family_and_r3(args.run, args.experiment)
        rows = fs.read_rows(args.run, api=api)
        side = args.refit_log
        if side is None and not str(args.run).startswith("wandb:"):
            from moerl.verl_ext.refit_log import beside

            found = beside(args.run)
            side = found if found.is_file() else None
        refit_log = fs.read_refit_log(side) if side is not None else None
        from moerl.verl_ext import expert_bias_log

        bias_log = args.expert_bias_log
        if bias_log is None and side is not None and expert_bias_log.beside(side).is_file():
            bias_log = expert_bias_log.beside(side)
        bias_verdict = expert_bias_log.check(bias_log) if bias_log is not None else None
        tensors = None
        if args.checkpoint:
            from moerl.verl_ext.checkpoint_check import read_checkpoint

            tensors = read_checkpoint(args.checkpoint)
    except (fs.RunReadError, OSError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    family = args.family or fam
    verdicts = fs.check(rows, family or "?", r3=bool(args.r3 or r3), floor=args.floor,
                        r3_unlogged_ok=args.r3_unlogged_ok, refit_undecided_ok=args.refit_undecided_ok,
                        refit_log=refit_log, refit_log_source=f"refit side log {side}")
    if bias_verdict is not None:
        verdicts.append(bias_verdict)
    if tensors is not None:
        from moerl.verl_ext.checkpoint_check import check_shared_expert_copies

        verdicts.append(check_shared_expert_copies(tensors, ep=args.ep))
    for v in verdicts:
        print(f"{'ok  ' if v.ok else 'FAIL'} [{v.name}] {v.detail}")
    failed = [v.name for v in verdicts if not v.ok]
    print(f"{args.run}: " + (f"{len(failed)} invariant(s) failed: {', '.join(failed)}" if failed else
                             "first steps pass every invariant"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
