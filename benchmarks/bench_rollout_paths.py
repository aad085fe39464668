"""The embedded rollout's decode paths side by side in one run: moerl's decode loop (the default,
``moerl.rollout.decode``), transformers' ``generate`` with its dynamic cache (``rollout.decode=generate``),
its static cache and, with ``--compile``, its torch.compile'd decode: time per rollout and whether each
batch is bit-identical to ``generate``'s.

    .venv/bin/python benchmarks/bench_rollout_paths.py [--arm experiments/07_dose_threshold/arms/baseline.yaml]
        [--rounds 3] [--compile] [--quick] [--out DIR | --record] [key=value ...]

``generate`` with a dynamic cache grows keys and values by one position per decode step.
``cache_implementation="static"`` pre-allocates the cache to the batch's full length, so every decode step
has the same shapes -- what a compiler needs --, and with a ``CompileConfig`` ``generate`` compiles the
decode forward (inductor on a CPU). Each variant generates the same prompts with the same seed (same
precision, emulated kernels, routing capture), in rotation, and is compared with ``generate``: sampled
tokens, rollout logprobs and routing trace, bit for bit. Prints median seconds per rollout, the ratio to
``generate`` and the identity checks; writes ``<out>/bench_rollout_paths.json``. The compiled variant's
first call (the compilation) is reported apart.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from moerl.bench_output import add_output_args, output_dir  # noqa: E402


def same_batch(a, b) -> dict:
    """Which parts of two RolloutBatches are bit-identical."""
    import torch

    shape = a.input_ids.shape == b.input_ids.shape
    return {"tokens": shape and torch.equal(a.input_ids, b.input_ids),
            "logprobs": shape and torch.equal(a.rollout_logprobs, b.rollout_logprobs),
            "routing": shape and a.routing is not None and b.routing is not None
            and torch.equal(a.routing.indices, b.routing.indices) and torch.equal(a.routing.valid, b.routing.valid)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", default="experiments/07_dose_threshold/arms/baseline.yaml")
    ap.add_argument("--rounds", type=int, default=3, help="timed generates per variant")
    ap.add_argument("--compile", action="store_true", help="also the compiled static decode (minutes to compile)")
    ap.add_argument("--quick", action="store_true", help="1 round")
    ap.add_argument("--threads", type=int, default=1)
    add_output_args(ap, "results/bench/rollout_paths")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    import torch
    from transformers import CompileConfig

    from moerl.config import load_config
    from moerl.data import load_splits
    from moerl.lora.peft_lora import apply_lora
    from moerl.rollout.hf import HFEngine
    from moerl.tracking import machine_info
    from moerl.trainer.warm_start import load_warm_start

    torch.set_num_threads(args.threads)
    rounds = 1 if args.quick else args.rounds
    cfg = load_config(args.arm, [f"threads={args.threads}", *args.overrides])
    base, tok, _ = load_warm_start(cfg, progress=False)
    policy = apply_lora(base, cfg.lora, cfg.model.preset)
    engine = HFEngine(policy, tok, cfg.rollout, cfg.data.task)
    rows = load_splits(cfg.data)[0][: cfg.rollout.prompts_per_step]
    questions, answers = [r["question"] for r in rows], [r["answer"] for r in rows]
    if engine.decode_loop_unsupported:
        raise SystemExit(f"{args.arm}: the decode loop does not cover this engine: {engine.decode_loop_unsupported}")
    plain_generate = engine.model.generate
    variants = {"generate": {}, "moerl decode loop": None, "generate, static cache": {"cache_implementation": "static"}}
    if args.compile:
        compiled = CompileConfig(fullgraph=False, dynamic=False, mode="default")
        compiled._compile_all_devices = True  # transformers compiles generate's decode on GPUs only unless told
        variants["generate, static cache + torch.compile"] = {"cache_implementation": "static",
                                                             "compile_config": compiled}

    def run(extra: dict | None, seed: int):
        """One rollout: the decode loop (``extra`` None) or generate with ``extra`` keyword arguments."""
        engine.decode_loop = extra is None
        engine.model.generate = (lambda *a, **kw: plain_generate(*a, **kw, **extra)) if extra else plain_generate
        try:
            start = time.perf_counter()
            batch = engine.generate(questions, answers, cfg.rollout.group_size, seed=seed)
            return batch, time.perf_counter() - start
        finally:
            engine.model.generate = plain_generate

    first_call = {name: run(extra, seed=0)[1] for name, extra in variants.items()}  # warm-up / compilation
    times = {name: [] for name in variants}
    identical = {name: {"tokens": True, "logprobs": True, "routing": True} for name in variants}
    for i in range(rounds):
        reference = None
        for name, extra in variants.items():
            batch, seconds = run(extra, seed=1 + i)
            times[name].append(seconds)
            if reference is None:
                reference = batch
            else:
                for key, same in same_batch(reference, batch).items():
                    identical[name][key] &= same
        print(f"round {i + 1}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()), flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    reference = medians["generate"]
    print(f"\n{cfg.rollout.prompts_per_step} x {cfg.rollout.group_size} samples, rollout.dtype={cfg.rollout.dtype}, "
          f"kernels={cfg.rollout.kernels}, {args.threads} thread(s), {rounds} round(s)")
    print(f"{'variant':40s} {'first call s':>12s} {'median s':>9s} {'/ generate':>10s}  bit-identical to generate")
    for name in variants:
        same = identical[name]
        print(f"{name:40s} {first_call[name]:12.2f} {medians[name]:9.2f} {medians[name] / reference:10.2f}  "
              + ("-" if name == "generate" else ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items())))
    result = {"arm": args.arm, "overrides": args.overrides, "rounds": rounds, "threads": args.threads,
              "first_call_s": first_call, "median_s": medians, "ratio_to_generate": {n: m / reference for n, m in medians.items()},
              "identical_to_generate": {n: v for n, v in identical.items() if n != "generate"},
              "machine": machine_info(), "when": time.strftime("%Y-%m-%d %H:%M")}
    out = output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rollout_paths.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'bench_rollout_paths.json'}")
    return result


if __name__ == "__main__":
    main()
