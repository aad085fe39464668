"""The trainer's forward + backward with transformers' grouped-experts forward against moerl's local one
(moerl.models.experts), alternated in one process: time per micro-batch and whether logprobs and every
LoRA gradient are bit-identical.

    .venv/bin/python benchmarks/bench_experts.py [--arm experiments/07_dose_threshold/arms/baseline.yaml]
        [--rounds 10] [--threads 1] [--compile] [--out DIR | --record] [key=value ...]

``--compile`` adds three sides: the same policy (moerl's local forward) under ``torch.compile`` (Inductor's
CPU backend, static shapes, a recompile limit that lets each MoE layer have its own graph), with how many
graphs and graph breaks Dynamo makes of one forward, its compile time, and how far its logprobs are from
the eager ones (a compiled path is not bit-identical: it would be its own run identity); and, as the
compiler's best case, the same warm-start model without LoRA, eager and compiled (one graph, no break: what
a trainer whose adapters Dynamo could trace would at most gain; its norm weights take the gradient, so the
backward runs through every layer as the trainer's does).

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
from moerl.bench_output import add_output_args, output_dir  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", default="experiments/07_dose_threshold/arms/baseline.yaml")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="also the policy under torch.compile (minutes to compile)")
    add_output_args(ap, "results/bench/experts")
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

    def forward_backward(implementation: str, model=policy, owner=(base, policy)):
        """One timed forward + backward of ``model``; ``owner``: (the model whose config picks the experts
        forward, the module whose gradients are read)."""
        owner[0].config._experts_implementation = implementation
        owner[1].zero_grad(set_to_none=True)
        start = time.perf_counter()
        logp, entropy = forward_logprobs(model, batch, cfg.rollout.temperature, with_entropy=True)
        (logp[batch.response_mask].sum() + entropy[batch.response_mask].mean()).backward()
        seconds = time.perf_counter() - start
        return seconds, logp.detach(), {n: p.grad.clone() for n, p in owner[1].named_parameters() if p.grad is not None}

    sides = {"transformers grouped_mm": ("grouped_mm", policy), "moerl local grouped_mm": (experts.NAME, policy)}
    reference = {name: forward_backward(*side) for name, side in sides.items()}  # warm-up and the identity check
    (_, logp_a, grads_a), (_, logp_b, grads_b) = reference.values()
    identical = {"logprobs": torch.equal(logp_a, logp_b),
                 "gradients": grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)}
    compiled = plain = None
    if args.compile:
        no_lora, _, _ = load_warm_start(cfg, progress=False)
        for name, p in no_lora.named_parameters():
            p.requires_grad_("norm" in name)
        no_lora.train()
        _, logp_plain, grads_plain = forward_backward(experts.NAME, no_lora, (no_lora, no_lora))
        graphs = {"policy": dynamo_graphs(policy, batch), "no LoRA": dynamo_graphs(no_lora, batch)}  # before any compile
        compiled = {**graphs["policy"], **compile_side(policy, (base, policy), batch, forward_backward, logp_b, grads_b)}
        sides["moerl local + torch.compile"] = (experts.NAME, compiled.pop("model"))
        plain = {**graphs["no LoRA"],
                 **compile_side(no_lora, (no_lora, no_lora), batch, forward_backward, logp_plain, grads_plain)}
        sides["no LoRA: eager"] = (experts.NAME, no_lora, (no_lora, no_lora))
        sides["no LoRA: torch.compile"] = (experts.NAME, plain.pop("model"), (no_lora, no_lora))
    times = {name: [] for name in sides}
    for i in range(args.rounds):
        order = list(sides.items()) if i % 2 == 0 else list(reversed(sides.items()))
        for name, side in order:
            times[name].append(forward_backward(*side)[0])
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = medians["moerl local grouped_mm"] / medians["transformers grouped_mm"]
    n, t = batch.input_ids.shape
    print(f"{n} rows x {t} positions, {args.threads} thread(s), {args.rounds} alternated rounds")
    for name in sides:
        print(f"  {name:28s} median {medians[name]:.3f} s  (min {min(times[name]):.3f}, max {max(times[name]):.3f})")
    print(f"  moerl / transformers: {ratio:.2f}; bit-identical: logprobs {identical['logprobs']}, "
          f"{len(grads_a)} LoRA gradients {identical['gradients']}")
    for label, c, compiled_side, eager_side in (("the policy", compiled, "moerl local + torch.compile", "moerl local grouped_mm"),
                                                ("no LoRA", plain, "no LoRA: torch.compile", "no LoRA: eager")):
        if c is None:
            continue
        c["ratio_to_eager"] = medians[compiled_side] / medians[eager_side]
        print(f"  {label}, torch.compile / eager: {c['ratio_to_eager']:.2f}; {c['graphs']} graph(s), "
              f"{c['graph_breaks']} graph break(s) per forward; compiled in {c['compile_seconds']:.0f} s; "
              f"max |logprob difference| {c['max_abs_logprob_difference']:.2e}, "
              f"max relative gradient difference {c['max_relative_gradient_difference']:.2e}")
    result = {"arm": args.arm, "overrides": args.overrides, "rounds": args.rounds, "threads": args.threads,
              "rows": n, "positions": t, "median_s": medians, "ratio": ratio, "identical": identical,
              "compiled": compiled, "compiled_without_lora": plain, "machine": machine_info(),
              "when": time.strftime("%Y-%m-%d %H:%M")}
    out = output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_experts.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'bench_experts.json'}")
    return result


def dynamo_graphs(model, batch) -> dict:
    """How many graphs and breaks Dynamo makes of one forward of ``model`` (its caches reset after)."""
    import torch

    # One graph per MoE layer is what a per-layer module guard gives; the default limit (8) would leave the
    # later layers eager and make the comparison unfair to the compiler.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
    explained = torch._dynamo.explain(model)(input_ids=batch.input_ids[:, :-1], attention_mask=batch.attention_mask[:, :-1],
                                             position_ids=batch.position_ids[:, :-1], use_cache=False)
    torch._dynamo.reset()
    return {"graphs": explained.graph_count, "graph_breaks": explained.graph_break_count,
            "break_reasons": sorted({str(b.reason).splitlines()[0][:160] for b in explained.break_reasons})}


def compile_side(model, owner, batch, forward_backward, eager_logp, eager_grads) -> dict:
    """``model`` under torch.compile: the compile time (the first forward + backward) and its distance from
    the eager numbers."""
    import torch

    from moerl.models import experts

    compiled = torch.compile(model, dynamic=False)
    start = time.perf_counter()
    _, logp, grads = forward_backward(experts.NAME, compiled, owner)
    compile_seconds = time.perf_counter() - start
    mask = batch.response_mask
    relative = max(float((grads[k] - eager_grads[k]).abs().max() / eager_grads[k].abs().max().clamp_min(1e-30))
                   for k in eager_grads)
    return {"model": compiled, "compile_seconds": compile_seconds,
            "max_abs_logprob_difference": float((logp - eager_logp)[mask].abs().max()),
            "max_relative_gradient_difference": relative}


if __name__ == "__main__":
    main()
