"""Rollout kernels, side by side: native bf16 vs emulated bf16 (fp32 kernels, bf16 rounding points),
with the fp32 rollout as the speed floor, under each oneDNN ISA cap in one run.

    .venv/bin/python benchmarks/bench_kernels.py [--arm experiments/00_tiny_moe_cpu/arms/baseline.yaml]
        [--rounds 6] [--warmup 1] [--threads 1] [--isa default,AVX2] [--out DIR | --record] [key=value ...]

For each ISA setting a child process is started with ``ONEDNN_MAX_CPU_ISA`` set (oneDNN reads it once,
at start-up; ``default`` leaves it unset): ``AVX2`` makes an AMX/AVX512-BF16 CPU run the kernels an
AVX2-only CPU (e.g. an AMD EPYC of the Zen 2/3 generations) has. In the child, three trainers of the same
arm and seed (rollout native bf16, emulated bf16, fp32) step in rotation, so machine noise hits all
alike. Prints per-phase medians and the ratios native / emulated for the rollout and the whole step,
and writes ``<out>/bench_kernels.json``. Targets: rollout >= 4x and step >= 2x faster on AVX2-only; on
a CPU with bf16 instructions, emulated no slower than native.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # isa_children: the per-ISA child runner the benches share
from moerl.bench_output import add_output_args, output_dir  # noqa: E402

from isa_children import report, run_per_isa  # noqa: E402

SIDES = {"native": ["rollout.kernels=native"], "emulated": ["rollout.kernels=emulated"],
         "fp32": ["rollout.dtype=fp32"]}
TARGETS = {"AVX2": {"rollout": 4.0, "step": 2.0}, "default": {"rollout": 1.0, "step": 1.0}}


def child(args) -> dict:
    """One ISA setting: the three trainers in rotation; returns medians per side and phase."""
    import torch

    from moerl.config import load_config
    from moerl.tracking import machine_info
    from moerl.trainer.grpo import GRPOTrainer

    overrides = ["trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.samples_every=0",
                 "tracking.wandb_mode=disabled", "tracking.progress_bar=false", f"threads={args.threads}",
                 *args.overrides]
    times: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {side: GRPOTrainer(load_config(args.arm, overrides + extra), Path(tmp) / side, progress=False)
                    for side, extra in SIDES.items()}
        order = list(SIDES)
        for i in range(args.warmup + args.rounds):
            walls = {}
            for side in order[i % 3:] + order[:i % 3]:
                start = time.perf_counter()
                logged = trainers[side].step()
                walls[side] = time.perf_counter() - start
                if i >= args.warmup:
                    times[side].append({**{k: v for k, v in logged.items() if k.startswith("time/")},
                                        "time/wall": walls[side]})
            print(f"  [{args.isa}] {'warm-up' if i < args.warmup else 'round'} {i + 1}: "
                  + ", ".join(f"{side} {walls[side]:.2f} s" for side in order), flush=True)
        for t in trainers.values():
            t.close()
    phases = sorted({k for rows in times.values() for row in rows for k in row})
    medians = {side: {k: statistics.median(r[k] for r in rows if k in r) for k in phases}
               for side, rows in times.items()}
    return {"isa": args.isa, "medians": medians, "rounds": args.rounds, "threads": args.threads,
            "machine": machine_info(), "torch": torch.__version__}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", default="experiments/00_tiny_moe_cpu/arms/baseline.yaml")
    ap.add_argument("--rounds", type=int, default=6, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", default="default,AVX2",
                    help="comma-separated ONEDNN_MAX_CPU_ISA values ('default': unset)")
    add_output_args(ap, "results/kernels")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.child:
        report(child(args))
        return {}
    results = run_per_isa(__file__, args.isa, ["--arm", args.arm, "--rounds", str(args.rounds), "--warmup",
                                               str(args.warmup), "--threads", str(args.threads), *args.overrides])
    print(f"\n{'ISA cap':8s} {'phase':14s} {'native s':>9s} {'emulated s':>10s} {'fp32 s':>7s} "
          f"{'native/emulated':>16s} {'target':>7s}")
    for r in results:
        m = r["medians"]
        for phase, key in (("rollout", "time/rollout"), ("step (wall)", "time/wall")):
            ratio = m["native"][key] / m["emulated"][key]
            target = TARGETS.get(r["isa"], TARGETS["default"])["rollout" if phase == "rollout" else "step"]
            r.setdefault("ratios", {})[phase] = ratio
            r.setdefault("targets_met", {})[phase] = ratio >= target
            print(f"{r['isa']:8s} {phase:14s} {m['native'][key]:9.3f} {m['emulated'][key]:10.3f} "
                  f"{m['fp32'][key]:7.3f} {ratio:16.2f} {'>=' + format(target, 'g'):>7s}"
                  f" {'met' if ratio >= target else 'NOT met'}")
    out = output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    result = {"arm": args.arm, "overrides": args.overrides, "results": results,
              "when": time.strftime("%Y-%m-%d %H:%M")}
    (out / "bench_kernels.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'bench_kernels.json'}")
    return result


if __name__ == "__main__":
    main()
