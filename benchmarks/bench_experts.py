"""The trainer's forward + backward with transformers' grouped-experts forward against moerl's local one
(moerl.models.experts), alternated in one process: time per micro-batch and whether logprobs and every
LoRA gradient are bit-identical.

    .venv/bin/python benchmarks/bench_experts.py [--arm experiments/07_dose_threshold/arms/baseline.yaml]
        [--rounds 10] [--threads 1] [--out results/bench/experts] [key=value ...]

One micro-batch of the arm's rollout (``trainer.micro_batch_size`` rows of a real rollout from the arm's
warm start, LoRA B drawn non-zero so every adapter has a gradient), the trainer's teacher-forced forward
with entropy, and a backward through both. Writes ``<out>/bench_experts.json``.
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", default="experiments/07_dose_threshold/arms/baseline.yaml")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/bench/experts")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    import torch

    from moerl.config import load_config
    from moerl.data import load_splits
    from moerl.lora.peft_lora import apply_lora
    from moerl.models import experts
    from moerl.rollout.hf import HFEngine
    from moerl.tracking import machine_info
    from moerl.trainer.logprobs import forward_logprobs
    from moerl.trainer.warm_start import load_warm_start

    torch.set_num_threads(args.threads)
    cfg = load_config(args.arm, [f"threads={args.threads}", *args.overrides])
    if cfg.model.experts_implementation != "grouped_mm":
        raise SystemExit(f"{args.arm}: model.experts_implementation is {cfg.model.experts_implementation!r}; "
                         f"this bench compares the two grouped_mm forwards")
    base, tok, _ = load_warm_start(cfg, progress=False)
    policy = apply_lora(base, cfg.lora, cfg.model.preset)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    engine = HFEngine(policy, tok, cfg.rollout, cfg.data.task)
    rows = load_splits(cfg.data)[0][: cfg.rollout.prompts_per_step]
    batch = engine.generate([r["question"] for r in rows], [r["answer"] for r in rows], cfg.rollout.group_size, seed=1)
    batch = batch.select(torch.arange(min(cfg.trainer.micro_batch_size, batch.input_ids.shape[0])))
    policy.train()

    def forward_backward(implementation: str):
        base.config._experts_implementation = implementation
        policy.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logp, entropy = forward_logprobs(policy, batch, cfg.rollout.temperature, with_entropy=True)
        (logp[batch.response_mask].sum() + entropy[batch.response_mask].mean()).backward()
        seconds = time.perf_counter() - start
        return seconds, logp.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    sides = {"transformers grouped_mm": "grouped_mm", "moerl local grouped_mm": experts.NAME}
    reference = {name: forward_backward(impl) for name, impl in sides.items()}  # warm-up and the identity check
    (_, logp_a, grads_a), (_, logp_b, grads_b) = reference.values()
    identical = {"logprobs": torch.equal(logp_a, logp_b),
                 "gradients": grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)}
    times = {name: [] for name in sides}
    for i in range(args.rounds):
        order = list(sides.items()) if i % 2 == 0 else list(reversed(sides.items()))
        for name, impl in order:
            times[name].append(forward_backward(impl)[0])
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = medians["moerl local grouped_mm"] / medians["transformers grouped_mm"]
    n, t = batch.input_ids.shape
    print(f"{n} rows x {t} positions, {args.threads} thread(s), {args.rounds} alternated rounds")
    for name in sides:
        print(f"  {name:26s} median {medians[name]:.3f} s  (min {min(times[name]):.3f}, max {max(times[name]):.3f})")
    print(f"  moerl / transformers: {ratio:.2f}; bit-identical: logprobs {identical['logprobs']}, "
          f"{len(grads_a)} LoRA gradients {identical['gradients']}")
    result = {"arm": args.arm, "overrides": args.overrides, "rounds": args.rounds, "threads": args.threads,
              "rows": n, "positions": t, "median_s": medians, "ratio": ratio, "identical": identical,
              "machine": machine_info(), "when": time.strftime("%Y-%m-%d %H:%M")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_experts.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'bench_experts.json'}")
    return result


if __name__ == "__main__":
    main()
