"""GRPO step time: the current step against the step before its optimisations, side by side in one run.

    .venv/bin/python benchmarks/bench_step.py [--arm experiments/00_tiny_moe_cpu/arms/baseline.yaml]
        [--rounds 8] [--warmup 2] [--threads N] [--out DIR | --record] [key=value ...]

Two trainers of the same arm and seed step in alternation (ABAB...), so machine noise hits both
alike. "before" runs each step with the optimisations switched off, as the code ran without them:
  - the rollout engine folds each expert LoRA into its weight on every forward (PEFT's own path)
    instead of once per generate (moerl.lora.peft_lora.expert_lora_materialised);
  - math-verify's parse caches keep their upstream size (20 entries) instead of a run's worth;
  - the engine generates on the process's threads (``rollout.threads=null``) instead of the arm's
    ``rollout.threads``;
  - the engine decodes with transformers' ``generate`` (``rollout.decode=generate``) instead of moerl's
    decode loop (moerl.rollout.decode, bit-identical to it), which needs the once-per-generate fold.
Both trainers must log the same metrics at every step (every value except wall-clock times): the
optimisations change no number. Prints per-phase medians, the speed-up and whether the target
(>= 2x) is met; writes ``<out>/bench_step.json`` (``bench_step_threads<N>.json`` with ``--threads N``).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager, nullcontext
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from moerl.bench_output import add_output_args, output_dir  # noqa: E402

import torch  # noqa: E402

import moerl.rollout.hf as hf  # noqa: E402
from moerl.config import load_config, resolved_threads  # noqa: E402
from moerl.tracking import machine_info  # noqa: E402
from moerl.trainer.grpo import GRPOTrainer  # noqa: E402

TARGET = 2.0
UPSTREAM_PARSE_CACHE = 20  # math_verify.parser's lru_cache(maxsize=20)


@contextmanager
def before_optimisations():
    """The step as it ran before: PEFT folds expert LoRA per forward; math-verify's small parse caches."""
    import math_verify.parser as parser

    with ExitStack() as stack:
        saved = {name: getattr(parser, name) for name in ("parse_latex_cached", "parse_expr_cached")}
        for name, fn in saved.items():
            setattr(parser, name, lru_cache(maxsize=UPSTREAM_PARSE_CACHE)(fn.__wrapped__))
            stack.callback(setattr, parser, name, fn)
        stack.callback(setattr, hf, "expert_lora_materialised", hf.expert_lora_materialised)
        hf.expert_lora_materialised = lambda model: nullcontext()
        # Rewards were verified in this process then (the parser patched above is this process's), and the
        # completion-level cache existed; in_process() empties it so neither side inherits the other's hits.
        from moerl import reward

        stack.enter_context(reward.in_process())
        yield


def comparable(metrics: dict) -> dict:
    """Every logged value except wall-clock times (time/*, refit/seconds)."""
    return {k: v for k, v in metrics.items() if not k.startswith("time/") and not k.endswith("seconds")}


def same(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (NaN equals NaN)."""
    def eq(x, y):
        return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
    return sorted(k for k in set(a) | set(b) if not eq(a.get(k), b.get(k)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", default="experiments/00_tiny_moe_cpu/arms/baseline.yaml")
    ap.add_argument("--rounds", type=int, default=8, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the arm's)")
    add_output_args(ap, "results/step")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    overrides = ["trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.samples_every=0",
                 "tracking.wandb_mode=disabled", "tracking.progress_bar=false", *args.overrides]
    if args.threads:
        overrides.append(f"threads={args.threads}")
    cfg = load_config(args.arm, overrides)
    configs = {"before": load_config(args.arm, overrides + ["rollout.threads=null", "rollout.decode=generate"]),
               "after": cfg}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {side: GRPOTrainer(configs[side], Path(tmp) / side, progress=False) for side in ("before", "after")}
        contexts = {"before": before_optimisations, "after": nullcontext}
        times: dict[str, list[dict]] = {"before": [], "after": []}
        differing: list[tuple[int, list[str]]] = []
        for i in range(args.warmup + args.rounds):
            logged = {}
            for side in ("before", "after") if i % 2 == 0 else ("after", "before"):
                with contexts[side]():
                    start = time.perf_counter()
                    logged[side] = trainers[side].step()
                    wall = time.perf_counter() - start
                if i >= args.warmup:
                    times[side].append({**{k: v for k, v in logged[side].items() if k.startswith("time/")},
                                        "time/wall": wall})
            diff = same(comparable(logged["before"]), comparable(logged["after"]))
            if diff:
                differing.append((i + 1, diff))
            print(f"step {i + 1}: before {logged['before']['time/step']:.3f} s, after {logged['after']['time/step']:.3f} s"
                  + (f"  DIFFERENT: {diff[:4]}" if diff else "  (same metrics)"), flush=True)
        for t in trainers.values():
            t.close()
    phases = sorted({k for rows in times.values() for row in rows for k in row})
    medians = {side: {k: statistics.median(r[k] for r in rows if k in r) for k in phases} for side, rows in times.items()}
    speedup = medians["before"]["time/wall"] / medians["after"]["time/wall"]
    spread = {side: (min(r["time/wall"] for r in rows), max(r["time/wall"] for r in rows)) for side, rows in times.items()}
    print(f"\n{'phase':28s} {'before s':>9s} {'after s':>9s} {'ratio':>6s}")
    for k in phases:
        b, a = medians["before"][k], medians["after"][k]
        print(f"{k:28s} {b:9.3f} {a:9.3f} {b / a if a else float('nan'):6.2f}")
    print(f"\nstep (wall, incl. reward): before {medians['before']['time/wall']:.3f} s "
          f"[{spread['before'][0]:.3f}-{spread['before'][1]:.3f}], after {medians['after']['time/wall']:.3f} s "
          f"[{spread['after'][0]:.3f}-{spread['after'][1]:.3f}] over {args.rounds} alternated steps each")
    print(f"speed-up {speedup:.2f}x (target >= {TARGET:g}x: {'met' if speedup >= TARGET else 'NOT met'}); "
          f"metrics identical at every step: {'yes' if not differing else 'NO, ' + str(differing[:3])}")
    result = {"arm": args.arm, "overrides": args.overrides, "threads": resolved_threads(cfg),
              "rollout_threads": cfg.rollout.threads, "rounds": args.rounds,
              "medians": medians, "spread_wall": spread, "speedup": speedup, "target": TARGET,
              "target_met": speedup >= TARGET, "metrics_identical": not differing,
              "differing_steps": differing, "machine": machine_info(),
              "torch": torch.__version__, "when": time.strftime("%Y-%m-%d %H:%M")}
    out = output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    record = out / (f"bench_step_threads{args.threads}.json" if args.threads else "bench_step.json")
    record.write_text(json.dumps(result, indent=1))
    print(f"wrote {record}")
    return result


if __name__ == "__main__":
    main()
