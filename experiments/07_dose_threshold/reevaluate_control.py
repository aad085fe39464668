"""The fp32 control's held-out pass@1 gain measured again with more completions per problem: is the
regime check's shortfall (one seed gains 0.0986 where 0.10 is required) within sampling noise?

    .venv/bin/python experiments/07_dose_threshold/reevaluate_control.py [--runs results/runs]
        [--checkpoints DIR] [--samples 32] [--out results/07_dose_threshold/control_reevaluated.json]

Supplementary: the regime rule is judged on the evaluation the runs recorded (4 completions per problem,
fp32 evaluator), and its verdict does not change with this measurement. For each control seed this
script restores the final checkpoint (``--checkpoints``: a tree of run directories that still hold their
``checkpoints/``, by default ``--runs``) into a fresh trainer built from the run's own config, checks that
the recorded evaluation is reproduced exactly, then measures pass@1 with ``--samples`` completions per
problem on the same 256 held-out problems — at step 0 (the warm start: the LoRA starts with B = 0, so the
policy is the same in every seed) and at the end. Nothing is written into the run directories.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from moerl.config import load_config  # noqa: E402
from moerl.analysis.dose import CONTROL_GAIN, EXPERIMENT  # noqa: E402
from moerl.tracking import read_metrics  # noqa: E402
from moerl.trainer.checkpoint import load_checkpoint  # noqa: E402
from moerl.trainer.grpo import GRPOTrainer  # noqa: E402


def trainer_for(run: Path, tmp: Path) -> GRPOTrainer:
    """A trainer with the run's config (one thread, nothing logged or saved) in a scratch directory."""
    cfg = load_config(run / "config.yaml", ["threads=1", "tracking.wandb_mode=disabled",
                                            "tracking.progress_bar=false", f"tracking.output_dir={tmp}"])
    return GRPOTrainer(cfg, tmp / run.name, progress=False)


def pass1(trainer: GRPOTrainer, samples: int) -> float:
    """Held-out pass@1 by the trainer's own evaluator (fp32 policy) with ``samples`` completions a problem."""
    trainer.cfg.trainer.eval_samples = samples
    return trainer.evaluate()["eval/pass1"]


def standard_error(p: float, n: int) -> float:
    """Binomial standard error of a share from n completions (an upper bound here: the problems are fixed)."""
    return math.sqrt(p * (1 - p) / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="results/runs", help="the recorded runs (metrics.jsonl, config.yaml)")
    ap.add_argument("--checkpoints", help="the same runs with their checkpoints/ (default: --runs)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--out", default="results/07_dose_threshold/control_reevaluated.json")
    args = ap.parse_args()
    recorded_root = Path(args.runs) / EXPERIMENT / "fp32_control"
    ckpt_root = Path(args.checkpoints or args.runs) / EXPERIMENT / "fp32_control"
    seeds = sorted(p for p in recorded_root.glob("seed*") if p.name[4:].isdigit())
    if not seeds:
        sys.exit(f"reevaluate_control: no control runs under {recorded_root}")
    missing = [str(ckpt_root / s.name / "checkpoints") for s in seeds if not (ckpt_root / s.name / "checkpoints").is_dir()]
    if missing:
        sys.exit(f"reevaluate_control: no checkpoints at {missing[0]}; pass --checkpoints with the run tree that "
                 "holds them (recorded runs are committed without checkpoints)")
    out = {"samples": args.samples, "required_gain": CONTROL_GAIN, "seeds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        start = None
        for run in seeds:
            rows = [r for r in read_metrics(run / "metrics.jsonl") if "eval/pass1" in r]
            first, last = rows[0], rows[-1]
            ckpt = ckpt_root / run.name / "checkpoints" / f"step_{last['step']}"
            trainer = trainer_for(run, Path(tmp))
            recorded_samples = trainer.cfg.trainer.eval_samples
            if start is None:  # the warm start: identical in every seed (LoRA B = 0)
                again = pass1(trainer, recorded_samples)
                if again != first["eval/pass1"]:
                    sys.exit(f"reevaluate_control: the warm start gives pass@1 {again} with the recorded "
                             f"{recorded_samples} samples, {run} logged {first['eval/pass1']} at step 0")
                start = pass1(trainer, args.samples)
            load_checkpoint(ckpt, trainer.policy, trainer.optimizer)
            again = pass1(trainer, recorded_samples)
            if again != last["eval/pass1"]:
                sys.exit(f"reevaluate_control: {ckpt} gives pass@1 {again} with the recorded {recorded_samples} "
                         f"samples, the run logged {last['eval/pass1']}: not the same policy or evaluator")
            end = pass1(trainer, args.samples)
            n = args.samples * len(trainer.test_rows)
            out["seeds"][run.name] = {
                "step": last["step"], "recorded": {"samples": recorded_samples, "start": first["eval/pass1"],
                                                   "end": last["eval/pass1"], "gain": last["eval/pass1"] - first["eval/pass1"]},
                "remeasured": {"start": start, "end": end, "gain": end - start,
                               "completions": n, "gain_se": math.hypot(standard_error(start, n), standard_error(end, n))}}
            trainer.close()
            r = out["seeds"][run.name]
            print(f"{run.name}: gain recorded {r['recorded']['gain']:+.4f} ({recorded_samples} samples), "
                  f"remeasured {r['remeasured']['gain']:+.4f} ± {r['remeasured']['gain_se']:.4f} ({args.samples} samples)",
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
