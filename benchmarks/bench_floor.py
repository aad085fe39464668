"""How far each phase of a GRPO step runs above its FLOP floor on this machine, for experiments 07 and 00.

    .venv/bin/python benchmarks/bench_floor.py [--quick] [--steps 6] [--isa default,AVX2] [--threads 1]
        [--regimes 07,00,qwen3_30b_a3b] [--out DIR | --record]

**The count.** Every matrix product of one step is counted from the model config and the batch's real
token counts (a multiply-add is 2 FLOPs; elementwise work, norms, softmaxes and the optimiser are left
out: they are not matrix work and a floor does not need them). Per token of one forward, per layer:

- attention projections: q (H -> nh*hd), k and v (H -> nkv*hd), o (nh*hd -> H);
- attention core: Q.K^T and P.V, 2 * 2 * nh * hd FLOPs per (query, attended key) pair, counting only the
  causal pairs a token needs (its own position and those before it, padding excluded);
- router: H -> E; experts: top_k experts of gate_up (H -> 2I) and down (I -> H), nothing for the E - k
  experts a token does not use;
- LoRA: r * (in + out) per adapted product (attention q/k/v/o; each of the token's top_k experts'
  gate_up and down), i.e. x.A then (x.A).B, never the folded E x out x in weight;
- lm_head: H -> V, only at the positions whose logits the phase needs (one per sampled token).

Phases, from the batch's real lengths (prompt p_i tokens, response L_i tokens incl. EOS):

- **rollout**: prefill over p_i tokens, then KV-cached decode of the L_i - 1 tokens that are fed back (the
  last sampled token is never forwarded); a token at position t attends t + 1 keys; lm_head at L_i positions.
- **old-logprob**: one teacher-forced forward over p_i + L_i - 1 positions, lm_head at the L_i response
  positions.
- **update**: ``trainer.epochs`` x (that forward + its backward). The backward takes every product's input
  gradient (as many FLOPs as its forward: the base weights are frozen and get no weight gradient), the
  attention core twice (both its operands are activations), and the LoRA factors' weight gradients (once
  more their forward). With frozen base weights this is ~2x a forward, not the 3x of full fine-tuning.

**The rate.** Each product's FLOPs are divided by this machine's one-thread fp32 GEMM rate *at that
product's own shape* (rows per call x in x out: the rollout's decode calls have N rows, the trainer's
N_micro x T; an expert gets rows x top_k / E of them; the attention core is a batched product), measured
here as the best of a few repeats of ``torch.mm`` / ``torch.bmm``. The floor of a phase is the sum of those
times: what a perfect implementation with this machine's kernels and no overhead would take. The rate at
1024^3 is printed beside it as the machine's peak.

**The measured side** is a short real run of the experiment's base arm (warm start, its batch and
precision), ``--steps`` GRPO steps on one thread after one untimed step, medians of the trainer's own
phase timers; the lengths that the floor counts are those this run sampled. Under each ``--isa`` value a
child process runs with ``ONEDNN_MAX_CPU_ISA`` set (``AVX2``: the kernels an AVX2-only CPU has). Prints
measured / floor per phase and the targets: 07's step <= 3x and rollout <= 5x its floor; a 300-step 07 run
<= 6 min (300 x the median step + its 7 evaluations x one timed evaluation); one GRPO step <= 15 s at
Qwen3-30B-A3B's routing geometry (regime ``qwen3_30b_a3b``: 07's width and batch with 48 MoE layers x 128
experts, top-8, random init); and the peak resident memory of the process after 07's steps and
evaluation (07 runs first). Writes ``<out>/bench_floor.json``. On a shared machine the measured side is
noisy: run it on a quiet one.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # isa_children: the per-ISA child runner the benches share
from moerl.bench_output import add_output_args, output_dir  # noqa: E402

from isa_children import report, run_per_isa  # noqa: E402

REGIMES = {"07": "experiments/07_dose_threshold/arms/baseline.yaml",
           "00": "experiments/00_tiny_moe_cpu/arms/baseline.yaml",
           "qwen3_30b_a3b": "experiments/07_dose_threshold/arms/baseline.yaml"}
# Qwen3-30B-A3B's routing geometry (48 MoE layers x 128 experts, top-8) at 07's width and batch, from a random
# init (no warm start exists at this geometry: answers run longer than 07's, a worst case for the step).
REGIME_OVERRIDES = {"qwen3_30b_a3b": ["model.num_layers=48", "model.num_experts=128", "model.top_k=8",
                                      "warm_start.enabled=false"]}
TARGETS = {"07": {"time/step": 3.0, "time/rollout": 5.0}}
STEP_SECONDS_TARGET = {"qwen3_30b_a3b": 15.0}  # one GRPO step at the papers' geometry
RUN_MINUTES_TARGET = {"07": 6.0}  # a 300-step 07 run, one thread
PHASES = ("time/rollout", "time/old_logprob", "time/update", "time/step")


@dataclass(frozen=True)
class Dims:
    """The matrix dimensions of a causal MoE LM with LoRA (every layer MoE, as the presets here)."""

    hidden: int
    layers: int
    experts: int
    top_k: int
    inter: int  # one expert's intermediate size
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rank: int = 0  # LoRA rank (0: no LoRA)
    lora_attention: bool = False
    lora_experts: bool = False

    @classmethod
    def of(cls, cfg, vocab: int) -> "Dims":
        m, lora = cfg.model, cfg.lora
        if m.preset not in ("qwen3_moe", "mixtral"):
            raise ValueError(f"bench_floor counts Qwen3-MoE/Mixtral layers (GQA attention, all layers MoE); "
                             f"model.preset={m.preset!r} is not one")
        return cls(m.hidden_size, m.num_layers, m.num_experts, m.top_k, m.moe_intermediate_size, m.num_heads,
                   m.num_kv_heads, m.head_dim, vocab, lora.rank, lora.target_attention, lora.target_experts)


@dataclass
class Count:
    """FLOPs of one phase, per product, each with the GEMM shape (rows, in, out) or the batched attention
    shape its rate is measured at."""

    terms: dict[str, float] = field(default_factory=dict)
    shapes: dict[str, tuple] = field(default_factory=dict)

    def add(self, name: str, flops: float, shape: tuple) -> None:
        self.terms[name] = self.terms.get(name, 0.0) + flops
        self.shapes.setdefault(name, shape)

    def merge(self, other: "Count", scale: float = 1.0, suffix: str = "") -> None:
        for name, flops in other.terms.items():
            self.add(name + suffix, flops * scale, other.shapes[name])

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def forward_count(d: Dims, tokens: float, pairs: float, logit_positions: float, rows: int,
                  queries_per_call: int = 1, keys_per_call: int = 1, sequences_per_call: int = 1) -> Count:
    """Matrix FLOPs of one forward over ``tokens`` token positions in which ``pairs`` (query, key) pairs
    are attended and ``logit_positions`` positions get logits. ``rows`` is the rows of one product call
    (for the rate); one attention call covers ``sequences_per_call`` sequences x heads, each
    ``queries_per_call`` x ``keys_per_call``."""
    c, L, H = Count(), d.layers, d.hidden
    q_out, kv_out = d.heads * d.head_dim, d.kv_heads * d.head_dim
    for name, fan_in, fan_out in (("q_proj", H, q_out), ("k_proj", H, kv_out), ("v_proj", H, kv_out),
                                  ("o_proj", q_out, H)):
        c.add(f"attention.{name}", 2 * tokens * fan_in * fan_out * L, (rows, fan_in, fan_out))
        if d.lora_attention and d.rank:
            c.add("lora.attention", 2 * tokens * d.rank * (fan_in + fan_out) * L, (rows, fan_in, d.rank))
    c.add("attention.core", 2 * 2 * pairs * d.heads * d.head_dim * L,
          ("bmm", sequences_per_call * d.heads, queries_per_call, d.head_dim, keys_per_call))
    c.add("router", 2 * tokens * H * d.experts * L, (rows, H, d.experts))
    expert_rows = max(1, rows * d.top_k // d.experts)
    routed = tokens * d.top_k
    c.add("experts.gate_up", 2 * routed * H * 2 * d.inter * L, (expert_rows, H, 2 * d.inter))
    c.add("experts.down", 2 * routed * d.inter * H * L, (expert_rows, d.inter, H))
    if d.lora_experts and d.rank:
        c.add("lora.experts", 2 * routed * d.rank * ((H + 2 * d.inter) + (d.inter + H)) * L,
              (expert_rows, H, d.rank))
    c.add("lm_head", 2 * logit_positions * H * d.vocab, (rows, H, d.vocab))
    return c


def backward_count(forward: Count) -> Count:
    """The backward of ``forward`` with frozen base weights: every product's input gradient (its forward
    FLOPs), the attention core once more (both operands are activations), the LoRA weight gradients."""
    c = Count()
    c.merge(forward, suffix=".grad_input")
    for name in forward.terms:
        if name == "attention.core" or name.startswith("lora."):
            c.add(name + ".grad_weight", forward.terms[name], forward.shapes[name])
    return c


@dataclass
class Lengths:
    """Real token counts of one rollout batch: prompt lengths p_i and response lengths L_i (EOS included)."""

    prompt: list[int]
    response: list[int]
    padded_prompt: int  # T0 of the batch
    padded_total: int  # T of the batch


def causal_pairs(start: int, stop: int) -> int:
    """(query, key) pairs when positions start..stop-1 each attend every position up to their own."""
    return sum(t + 1 for t in range(start, stop))


def phase_counts(d: Dims, lengths: Lengths, micro_batch: int, epochs: int) -> dict[str, Count]:
    """FLOP counts of the rollout, the old-logprob pass and the update of one step (see the docstring)."""
    n = len(lengths.prompt)
    prefill_tokens = sum(lengths.prompt)
    decode_tokens = sum(max(0, r - 1) for r in lengths.response)
    sampled = sum(lengths.response)
    prefill_pairs = sum(causal_pairs(0, p) for p in lengths.prompt)
    decode_pairs = sum(causal_pairs(p, p + r - 1) for p, r in zip(lengths.prompt, lengths.response))
    rollout = Count()
    rollout.merge(forward_count(d, prefill_tokens, prefill_pairs, 0, n * lengths.padded_prompt,
                                lengths.padded_prompt, lengths.padded_prompt, n), suffix="@prefill")
    rollout.merge(forward_count(d, decode_tokens, decode_pairs, sampled, n, 1, lengths.padded_total, n),
                  suffix="@decode")
    t = lengths.padded_total - 1
    micro = min(micro_batch, n)
    rows = micro * t
    tokens = sum(p + r - 1 for p, r in zip(lengths.prompt, lengths.response))
    pairs = prefill_pairs + decode_pairs
    forward = forward_count(d, tokens, pairs, sampled, rows, t, t, micro)
    update = Count()
    update.merge(forward, scale=epochs)
    update.merge(backward_count(forward), scale=epochs)
    return {"time/rollout": rollout, "time/old_logprob": forward, "time/update": update}


class GemmRates:
    """One-thread fp32 FLOP/s of ``torch.mm`` / ``torch.bmm`` at given shapes, best of ``repeats`` timings
    (each long enough to be timed), cached per shape."""

    def __init__(self, repeats: int = 5, min_seconds: float = 0.02):
        self.repeats, self.min_seconds, self.cache = repeats, min_seconds, {}

    def __call__(self, shape: tuple) -> float:
        if shape not in self.cache:
            self.cache[shape] = self._measure(shape)
        return self.cache[shape]

    def _measure(self, shape: tuple) -> float:
        import torch

        if shape[0] == "bmm":  # attention core: (batch=heads, queries, head_dim, keys), Q.K^T and P.V
            _, heads, q, hd, k = shape
            a, b = torch.randn(heads, q, hd), torch.randn(heads, hd, k)
            p, v = torch.randn(heads, q, k), torch.randn(heads, k, hd)
            flops = 2 * 2 * heads * q * hd * k

            def run():
                torch.bmm(a, b)
                torch.bmm(p, v)
        else:
            m, k, n = shape
            a, b = torch.randn(m, k), torch.randn(k, n)
            flops = 2 * m * k * n

            def run():
                torch.mm(a, b)
        run()
        inner, best = 1, float("inf")
        while True:  # enough calls per timing that the clock resolves them
            start = time.perf_counter()
            for _ in range(inner):
                run()
            elapsed = time.perf_counter() - start
            if elapsed >= self.min_seconds:
                break
            inner *= 4
        best = elapsed / inner
        for _ in range(self.repeats - 1):
            start = time.perf_counter()
            for _ in range(inner):
                run()
            best = min(best, (time.perf_counter() - start) / inner)
        return flops / best


def floor_seconds(count: Count, rates: GemmRates) -> float:
    return sum(flops / rates(count.shapes[name]) for name, flops in count.terms.items() if flops)


def measure_run(arm: str, steps: int, threads: int, overrides: list[str],
                time_eval: bool = False) -> tuple[dict, list[Lengths], object]:
    """Median phase times of ``steps`` GRPO steps of ``arm`` (after one untimed step), the lengths each
    timed step sampled, and the config; with ``time_eval`` also one held-out evaluation's seconds
    (``time/eval``)."""

    from moerl.config import load_config
    from moerl.trainer.grpo import GRPOTrainer

    cfg = load_config(arm, ["trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.samples_every=0",
                            "tracking.wandb_mode=disabled", "tracking.progress_bar=false", f"threads={threads}",
                            *overrides])
    lengths: list[Lengths] = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = GRPOTrainer(cfg, Path(tmp) / "run", progress=False)
        generate = trainer.engine.generate

        def recording(*args, **kwargs):
            batch = generate(*args, **kwargs)
            t0 = batch.prompt_length
            lengths.append(Lengths([int(x) for x in batch.attention_mask[:, :t0].sum(-1)],
                                   [int(x) for x in batch.response_mask.sum(-1)], t0, batch.input_ids.shape[1]))
            return batch

        trainer.engine.generate = recording
        rows = []
        for i in range(steps + 1):
            logged = trainer.step()
            if i:
                rows.append(logged)
            print(f"  step {i + 1}/{steps + 1}: {logged['time/step']:.2f} s"
                  f"{' (untimed)' if i == 0 else ''}", flush=True)
        if time_eval:
            start = time.perf_counter()
            trainer.evaluate()
            eval_seconds = time.perf_counter() - start
        trainer.close()
    medians = {k: statistics.median(r[k] for r in rows) for k in PHASES}
    if time_eval:
        medians["time/eval"] = eval_seconds
    return medians, lengths[1:], cfg


def child(args) -> dict:
    import torch

    from moerl.data.tokenizer import build_tokenizer
    from moerl.tracking import machine_info

    torch.set_num_threads(args.threads)
    rates = GemmRates(repeats=3 if args.quick else 5)
    peak = rates((1024, 1024, 1024))
    out = {"isa": args.isa, "threads": args.threads, "peak_gflops_1024": peak / 1e9, "regimes": {},
           "machine": machine_info(), "torch": torch.__version__}
    vocab = len(build_tokenizer())
    for regime in args.regimes.split(","):
        print(f"[{args.isa}] {regime}: {REGIMES[regime]} {' '.join(REGIME_OVERRIDES.get(regime, []))}, "
              f"{args.steps} timed steps", flush=True)
        measured, lengths, cfg = measure_run(REGIMES[regime], args.steps, args.threads,
                                             REGIME_OVERRIDES.get(regime, []) + args.overrides,
                                             time_eval=regime in RUN_MINUTES_TARGET)
        # Peak resident memory of this process so far (Linux: KiB): after 07, which runs first, its run's peak.
        peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        dims = Dims.of(cfg, vocab)
        floors, gflop = {}, {}
        per_step = []
        for batch in lengths:
            counts = phase_counts(dims, batch, cfg.trainer.micro_batch_size, cfg.trainer.epochs)
            per_step.append({k: (c.total, floor_seconds(c, rates)) for k, c in counts.items()})
        for phase in PHASES[:-1]:
            gflop[phase] = statistics.median(s[phase][0] for s in per_step) / 1e9
            floors[phase] = statistics.median(s[phase][1] for s in per_step)
        gflop["time/step"] = sum(gflop[p] for p in PHASES[:-1])
        floors["time/step"] = sum(floors[p] for p in PHASES[:-1])
        example = phase_counts(dims, lengths[0], cfg.trainer.micro_batch_size, cfg.trainer.epochs)
        if "time/eval" in measured:  # a whole run: its steps and its evaluations (every eval_every, and step 0)
            evals = 1 + (cfg.trainer.steps // cfg.trainer.eval_every if cfg.trainer.eval_every else 0)
            run_minutes = (cfg.trainer.steps * measured["time/step"] + evals * measured["time/eval"]) / 60
        else:
            run_minutes = None
        out["regimes"][regime] = {
            "run_minutes_estimate": run_minutes, "trainer_steps": cfg.trainer.steps,
            "arm": REGIMES[regime], "measured_s": measured, "floor_s": floors, "gflop": gflop,
            "ratio": {p: measured[p] / floors[p] for p in PHASES},
            "overrides": REGIME_OVERRIDES.get(regime, []),
            "effective_gflops": {p: gflop[p] / floors[p] for p in PHASES},
            "mean_prompt_tokens": statistics.mean(x for b in lengths for x in b.prompt),
            "mean_response_tokens": statistics.mean(x for b in lengths for x in b.response),
            "samples_per_step": len(lengths[0].prompt),
            "peak_rss_mib_so_far": peak_rss_mib,
            "terms_gflop_first_step": {p: {k: v / 1e9 for k, v in c.terms.items()} for p, c in example.items()},
        }
    out["rates_gflops"] = {str(k): v / 1e9 for k, v in rates.cache.items()}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="timed GRPO steps per regime (after one untimed)")
    ap.add_argument("--quick", action="store_true", help="2 timed steps, fewer GEMM repeats, default ISA only")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", default="default,AVX2", help="comma-separated ONEDNN_MAX_CPU_ISA values "
                                                           "('default': unset)")
    ap.add_argument("--regimes", default="07,00,qwen3_30b_a3b", help=f"comma-separated, of {sorted(REGIMES)} "
                                                                     "(07 first: its peak memory is read after it)")
    add_output_args(ap, "results/bench/floor")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every regime's run")
    args = ap.parse_args(argv)
    unknown = [r for r in args.regimes.split(",") if r not in REGIMES]
    if unknown:
        ap.error(f"--regimes: unknown {unknown} (have: {sorted(REGIMES)})")
    if args.quick:
        args.steps = min(args.steps, 2)
        if "--isa" not in (argv if argv is not None else sys.argv[1:]):
            args.isa = "default"
    if args.child:
        report(child(args))
        return {}
    results = run_per_isa(__file__, args.isa, ["--steps", str(args.steps), "--threads", str(args.threads),
                                               "--regimes", args.regimes, *(["--quick"] if args.quick else []),
                                               *args.overrides], threads=args.threads)
    for r in results:
        print(f"\nONEDNN_MAX_CPU_ISA={r['isa']}, {r['threads']} thread(s); fp32 GEMM peak at 1024^3: "
              f"{r['peak_gflops_1024']:.0f} GFLOP/s")
        for regime, res in r["regimes"].items():
            print(f"{regime} ({res['samples_per_step']} samples, prompt {res['mean_prompt_tokens']:.1f} + "
                  f"response {res['mean_response_tokens']:.1f} tokens):")
            print(f"  {'phase':18s} {'GFLOP':>7s} {'GFLOP/s@shape':>13s} {'floor s':>8s} {'measured s':>10s} "
                  f"{'measured/floor':>14s} {'target':>7s}")
            for p in PHASES:
                target = TARGETS.get(regime, {}).get(p)
                ratio = res["ratio"][p]
                verdict = "" if target is None else f"<={target:g} {'met' if ratio <= target else 'NOT met'}"
                print(f"  {p[5:]:18s} {res['gflop'][p]:7.2f} {res['effective_gflops'][p]:13.1f} "
                      f"{res['floor_s'][p]:8.3f} {res['measured_s'][p]:10.3f} {ratio:14.1f} {verdict:>7s}")
            if regime in STEP_SECONDS_TARGET:
                step, target = res["measured_s"]["time/step"], STEP_SECONDS_TARGET[regime]
                print(f"  one GRPO step {step:.1f} s (target <= {target:g} s: {'met' if step <= target else 'NOT met'})")
            if res.get("run_minutes_estimate") is not None:
                minutes, target = res["run_minutes_estimate"], RUN_MINUTES_TARGET[regime]
                print(f"  a {res['trainer_steps']}-step run: {minutes:.1f} min = steps x median step + evaluations x "
                      f"one evaluation ({res['measured_s']['time/eval']:.1f} s) (target <= {target:g} min: "
                      f"{'met' if minutes <= target else 'NOT met'})")
            print(f"  peak resident memory of the bench process so far: {res['peak_rss_mib_so_far']:.0f} MiB")
    out = output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    result = {"steps": args.steps, "quick": args.quick, "overrides": args.overrides, "results": results,
              "targets": TARGETS, "when": time.strftime("%Y-%m-%d %H:%M")}
    (out / "bench_floor.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'bench_floor.json'}")
    return result


if __name__ == "__main__":
    main()
