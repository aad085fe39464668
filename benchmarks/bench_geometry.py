"""Time one experiment-06 measurement pass at a cluster routing geometry, and say where the time goes.

    python benchmarks/bench_geometry.py                       # Kimi-K2 geometry (60 MoE layers x 384 experts), hidden 64
    python benchmarks/bench_geometry.py --geometry deepseek_v3 --experts-implementation batched_mm
    python benchmarks/bench_geometry.py --profile             # also the top operators of the rollout (torch profiler)

Writes ``<out>/bench_geometry_<geometry>_h<hidden>.json`` (default out: runs/bench/geometry; results/bench/geometry with --record): each phase's
seconds, the pass's total against its budget, the machine and its load average while the pass ran (other
work on the CPU slows it, so the load is part of the figure).

A pass is what scripts/measure_geometry.py does per point and dtype: build the bf16 engine (emulated
kernels, as experiment 06 pins), sample 8 prompts x 8 completions with routing capture, then the fp32
trainer's forward routing natively and replaying the rollout's experts (R3). Runs on one thread; the
budget is 60 s per pass on one core of the 2-core CPU the experiment was sized for.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from moerl.bench_output import add_output_args, output_dir
from moerl.config import load_config
from moerl.data import load_splits
from moerl.data.tokenizer import build_tokenizer
from moerl.models.geometry import geometry_model_config
from moerl.models.presets import build_model
from moerl.analysis.routing_geometry import measure
from moerl.tracking import atomic_write_text, machine_info

BUDGET_SECONDS = 60.0  # per pass, on one core of the 2-core CPU experiment 06 was sized for


ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="kimi_k2")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--experts-implementation", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"])
    ap.add_argument("--profile", action="store_true", help="profile a second rollout and print its top operators")
    add_output_args(ap, "results/bench/geometry")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "experiments/06_routing_geometry/base.yaml")
    width = {} if args.hidden == 64 else dict(hidden_size=args.hidden, moe_intermediate_size=args.hidden // 2,
                                               num_heads=args.hidden // 32, num_kv_heads=max(args.hidden // 64, 1))
    cfg.model = geometry_model_config(args.geometry, experts_implementation=args.experts_implementation, **width)
    tok = build_tokenizer()
    rows = load_splits(cfg.data)[1][: args.prompts]
    start = time.perf_counter()
    model = build_model(cfg.model, tok, seed=0)
    build = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    r = measure(model, tok, cfg, rows, dtype="bf16", seed=0, resamples=2000)
    total = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    s = r["seconds"]
    stats = total - sum(s.values())
    tokens = r["all/tokens"]
    print(f"{args.geometry} at hidden {cfg.model.hidden_size}: {cfg.model.num_layers} layers, "
          f"{len(r['moe_layers'])} MoE x {cfg.model.num_experts} experts top-{cfg.model.top_k}, "
          f"{params / 1e6:.1f}M parameters, experts {args.experts_implementation}, threads {torch.get_num_threads()}")
    print(f"{args.prompts} prompts x {cfg.rollout.group_size} samples, {r['response_length_mean']:.1f} response tokens "
          f"on average, {tokens:.0f} routed positions")
    print(f"  model build (random init, not in the pass) {build:7.2f} s")
    for name, sec in (("engine build (bf16 copy)", s["engine_build"]), ("rollout (generate + capture)", s["rollout"]),
                      ("trainer fp32, native routing", s["trainer_native"]),
                      ("trainer fp32, R3 replay", s["trainer_replay"]), ("statistics (bootstrap)", stats)):
        print(f"  {name:40s} {sec:7.2f} s  {100 * sec / total:5.1f} %")
    print(f"  measurement pass                         {total:7.2f} s  (budget {BUDGET_SECONDS:.0f} s: "
          f"{'within' if total <= BUDGET_SECONDS else 'OVER'}; 1-minute load average {load_before:.1f} → "
          f"{load_after:.1f})")
    phases = {"engine_build": s["engine_build"], "rollout": s["rollout"], "trainer_native": s["trainer_native"],
              "trainer_replay": s["trainer_replay"], "statistics": stats}
    out = output_dir(args) / f"bench_geometry_{args.geometry}_h{cfg.model.hidden_size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "geometry": args.geometry, "hidden": cfg.model.hidden_size, "layers": cfg.model.num_layers,
        "moe_layers": len(r["moe_layers"]), "experts": cfg.model.num_experts, "top_k": cfg.model.top_k,
        "parameters": params, "experts_implementation": args.experts_implementation, "prompts": args.prompts,
        "group_size": cfg.rollout.group_size, "routed_positions": tokens, "seconds": phases, "pass_seconds": total,
        "budget_seconds": BUDGET_SECONDS, "within_budget": total <= BUDGET_SECONDS,
        "load_average_1min": [load_before, load_after], "machine": machine_info(),
        "when": time.strftime("%Y-%m-%d %H:%M")}
    atomic_write_text(out, json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    if args.profile:
        from moerl.rollout.hf import HFEngine

        engine = HFEngine(model, tok, cfg.rollout, cfg.data.task)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.generate([q["question"] for q in rows], [q["answer"] for q in rows], cfg.rollout.group_size, seed=0)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return record


if __name__ == "__main__":
    main()
