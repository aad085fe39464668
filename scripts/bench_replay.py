"""Router Replay benchmark: packed trace sizes, and replay overhead against the same arm without replay.

    .venv/bin/python scripts/bench_replay.py [--config experiments/00_tiny_moe_cpu/base.yaml]
        [--repeats 5] [--trainer-steps 4] [--no-trainer] [--out results/replay]

1. Packed trace size per token for the paper models (L * k * ceil(log2 E) bits) -> trace_sizes.json.
2. Overhead, all measured side by side in this one run (interleaved repeats, medians):
   a. components on the default model and batch: engine capture (routing hooks during transformers
      ``generate`` in the engine's dtype), packing (pack + unpack), and the trainer's old-logprob
      pass and update pass (forward + backward) under R3 replay vs the same passes without replay;
   b. when ``moerl.trainer.grpo.GRPOTrainer`` is importable: whole GRPO steps of the arm with
      ``replay.mode=none, rollout.capture_routing=false`` against the same arm with R3, alternated
      step by step, plus routing agreement and k3 mismatch per arm (warm start disabled here, so the
      policy is the random init: timings are what matter, rewards are not).
   Figures -> overhead.json. On a shared CPU, noise between repeats is printed next to each ratio.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from moerl.config import ExperimentConfig, load_config  # noqa: E402
from moerl.replay.capture import record_generation  # noqa: E402
from moerl.replay.packing import pack, paper_model_sizes, unpack  # noqa: E402
from moerl.replay.session import routing_session  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sizes(out: Path) -> list[dict]:
    rows = paper_model_sizes()
    print(f"{'model':26s} {'MoE layers':>10s} {'k':>3s} {'E':>4s} {'bits':>4s} {'packed B/tok':>12s} "
          f"{'uint8/int16':>11s} {'int16':>6s} {'int32':>6s} {'packed/int16':>12s}")
    for r in rows:
        print(f"{r['model']:26s} {r['moe_layers']:10d} {r['top_k']:3d} {r['num_experts']:4d} {r['bits_per_id']:4d} "
              f"{r['packed_bytes']:12.0f} {r['smallest_int_bytes']:11d} {r['int16_bytes']:6d} {r['int32_bytes']:6d} "
              f"{r['packed_bytes'] / r['int16_bytes']:12.3f}")
    (out / "trace_sizes.json").write_text(json.dumps(rows, indent=1))
    return rows


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _chunks(n: int, size: int):
    return [torch.arange(i, min(i + size, n)) for i in range(0, n, size)]


def components(cfg: ExperimentConfig, repeats: int) -> dict:
    """Capture, packing and replay costs on the arm's model and batch shape, against no replay."""
    from moerl.data.tokenizer import build_tokenizer
    from moerl.lora.peft_lora import apply_lora
    from moerl.models.presets import build_model

    tok = build_tokenizer()
    policy = apply_lora(build_model(cfg.model, tok, seed=0), cfg.lora, cfg.model.preset)
    engine = copy.deepcopy(policy).to(DTYPES[cfg.rollout.dtype]).eval()
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    g = torch.Generator().manual_seed(0)
    prompt_len = 8  # arith prompts are ~8 tokens; responses max_new_tokens: ~16 tokens in all
    prompts = torch.randint(3, len(tok), (cfg.rollout.prompts_per_step, prompt_len), generator=g)
    prompts = prompts.repeat_interleave(cfg.rollout.group_size, 0)
    pmask = torch.ones_like(prompts)
    for i in range(0, n, 3):  # some left padding, as real prompts have
        pmask[i, : i % 3] = 0
    gen_kw = dict(max_new_tokens=cfg.rollout.max_new_tokens, min_new_tokens=cfg.rollout.max_new_tokens,
                  do_sample=True, top_k=0, pad_token_id=tok.pad_token_id)

    def generate(capture: bool):
        torch.manual_seed(1)
        with torch.no_grad():
            if not capture:
                return engine.generate(input_ids=prompts, attention_mask=pmask, **gen_kw), None
            with record_generation(engine, n) as rec:
                seqs = engine.generate(input_ids=prompts, attention_mask=pmask, **gen_kw)
            mask = torch.cat([pmask, torch.ones(n, seqs.shape[1] - prompt_len, dtype=pmask.dtype)], 1)
            return seqs, rec.to_trace(mask)

    seqs, trace = generate(True)
    mask = torch.cat([pmask, torch.ones(n, seqs.shape[1] - prompt_len, dtype=pmask.dtype)], 1)
    t = seqs.shape[1] - 1
    ids, am = seqs[:, :-1], mask[:, :-1]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    fwd_trace = trace.truncate_tokens(t)
    mb = cfg.trainer.micro_batch_size

    def old_pass(mode: str):
        with torch.no_grad():
            for rows in _chunks(n, mb):
                if mode == "plain":
                    policy(input_ids=ids[rows], attention_mask=am[rows], position_ids=pos[rows], use_cache=False)
                    continue
                with routing_session(policy, (len(rows), t), replay=fwd_trace[rows] if mode == "R3" else None) as s:
                    policy(input_ids=ids[rows], attention_mask=am[rows], position_ids=pos[rows], use_cache=False)
                s.to_trace(am[rows].bool())  # the recording/diagnostic the trainer keeps

    def update_pass(mode: str):
        for rows in _chunks(n, mb):
            if mode == "plain":
                out = policy(input_ids=ids[rows], attention_mask=am[rows], position_ids=pos[rows], use_cache=False)
                out.logits.float().logsumexp(-1).mean().backward()
                continue
            with routing_session(policy, (len(rows), t), replay=fwd_trace[rows] if mode == "R3" else None):
                out = policy(input_ids=ids[rows], attention_mask=am[rows], position_ids=pos[rows], use_cache=False)
                out.logits.float().logsumexp(-1).mean().backward()
        policy.zero_grad(set_to_none=True)

    jobs = {
        "generate_plain": lambda: generate(False), "generate_capture": lambda: generate(True),
        "pack_unpack": lambda: unpack(pack(trace)),
        "old_plain": lambda: old_pass("plain"), "old_session": lambda: old_pass("none"),
        "old_r3": lambda: old_pass("R3"),
        "update_plain": lambda: update_pass("plain"), "update_session": lambda: update_pass("none"),
        "update_r3": lambda: update_pass("R3"),
    }
    times = {k: [] for k in jobs}
    for r in range(repeats + 1):  # interleaved; the first round is a warm-up and is dropped
        for name, job in jobs.items():
            dt = _timed(job)
            if r:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}  # least-contended run: the cost itself on a shared CPU
    spread = {k: (max(v) - min(v)) / statistics.median(v) for k, v in times.items()}
    # One GRPO step of the default arm: rollout + old-logprob pass + (epochs x) update passes.
    step = med["generate_plain"] + med["old_plain"] + cfg.trainer.epochs * med["update_plain"]
    capture = med["generate_capture"] - med["generate_plain"]
    replay_vs_plain = (med["old_r3"] - med["old_plain"]) + cfg.trainer.epochs * (med["update_r3"] - med["update_plain"])
    replay_vs_session = ((med["old_r3"] - med["old_session"])
                         + cfg.trainer.epochs * (med["update_r3"] - med["update_session"]))
    best_step = best["generate_plain"] + best["old_plain"] + cfg.trainer.epochs * best["update_plain"]
    best_over = ((best["generate_capture"] - best["generate_plain"]) + best["pack_unpack"]
                 + (best["old_r3"] - best["old_session"])
                 + cfg.trainer.epochs * (best["update_r3"] - best["update_session"]))
    packed = pack(trace)
    res = {
        "min_s": best, "overhead_pct_vs_none_arm_min": 100 * best_over / best_step,
        "batch": [n, int(seqs.shape[1])], "valid_rows": int(trace.valid.sum()), "repeats": repeats,
        "median_s": med, "spread_rel": spread, "step_estimate_s": step,
        "capture_s": capture, "pack_unpack_s": med["pack_unpack"],
        "replay_vs_no_hooks_s": replay_vs_plain, "replay_vs_diagnostic_session_s": replay_vs_session,
        "overhead_pct_vs_no_hooks": 100 * (capture + med["pack_unpack"] + replay_vs_plain) / step,
        "overhead_pct_vs_none_arm": 100 * (capture + med["pack_unpack"] + replay_vs_session) / step,
        "trace_bytes_packed": packed.nbytes,
        "trace_bytes_unpacked": trace.indices.numel() * trace.indices.element_size() + trace.valid.numel(),
    }
    print(f"\ncomponents ({cfg.model.preset}, batch {n}x{seqs.shape[1]}, {repeats} interleaved repeats, medians; "
          f"spread = (max-min)/median):")
    for k in jobs:
        print(f"  {k:18s} {med[k] * 1e3:9.1f} ms   spread {spread[k]:.2f}")
    print(f"  step estimate {step * 1e3:.0f} ms; capture {capture * 1e3:+.1f} ms, pack+unpack "
          f"{med['pack_unpack'] * 1e3:.2f} ms, replay {replay_vs_plain * 1e3:+.1f} ms vs no hooks / "
          f"{replay_vs_session * 1e3:+.1f} ms vs the diagnostic session")
    print(f"  overhead: {res['overhead_pct_vs_none_arm']:+.2f}% of a step vs the none arm (which keeps the "
          f"diagnostic session), {res['overhead_pct_vs_no_hooks']:+.2f}% vs no hooks at all")
    print(f"  same from the minimum over repeats: {res['overhead_pct_vs_none_arm_min']:+.2f}% vs the none arm")
    print(f"  trace: {packed.nbytes} B packed vs {res['trace_bytes_unpacked']} B unpacked")
    return res


def mismatch_by_preset(cfg: ExperimentConfig, presets: list[str], prompts: int = 16) -> dict:
    """Routing agreement and k3 between a bf16 engine and the fp32 trainer, without and with R3, per
    preset, on one rollout batch of the random-init model (same weights on both sides)."""
    from moerl.data.tokenizer import build_tokenizer
    from moerl.models.presets import build_model
    from moerl.replay.diagnostics import routing_metrics
    from moerl.trainer.metrics import mismatch_metrics

    tok = build_tokenizer()
    out = {}
    print(f"\nmismatch per preset ({prompts}x{cfg.rollout.group_size} samples, engine {cfg.rollout.dtype}, "
          f"trainer fp32, init_std {cfg.model.init_std}):")
    for preset in presets:
        mcfg = copy.deepcopy(cfg.model)
        mcfg.preset = preset
        model = build_model(mcfg, tok, seed=0)
        engine = copy.deepcopy(model).to(DTYPES[cfg.rollout.dtype]).eval()
        n = prompts * cfg.rollout.group_size
        g = torch.Generator().manual_seed(0)
        prompt_ids = torch.randint(3, len(tok), (prompts, 8), generator=g).repeat_interleave(cfg.rollout.group_size, 0)
        pmask = torch.ones_like(prompt_ids)
        torch.manual_seed(2)
        with torch.no_grad(), record_generation(engine, n) as rec:
            gen = engine.generate(input_ids=prompt_ids, attention_mask=pmask, max_new_tokens=cfg.rollout.max_new_tokens,
                                  min_new_tokens=cfg.rollout.max_new_tokens, do_sample=True, top_k=0,
                                  pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
        seqs = gen.sequences
        new = seqs[:, 8:]
        mask = torch.ones_like(seqs)
        trace = rec.to_trace(mask)
        rollout_logp = torch.zeros(seqs.shape, dtype=torch.float32)
        rollout_logp[:, 8:] = torch.log_softmax(torch.stack(gen.logits, 1).float(), -1).gather(
            -1, new.unsqueeze(-1)).squeeze(-1)
        resp = torch.zeros(seqs.shape, dtype=torch.bool)
        resp[:, 8:] = True
        t = seqs.shape[1] - 1
        row = {}
        for mode in ("none", "R3"):
            replay = trace.truncate_tokens(t) if mode == "R3" else None
            with torch.no_grad(), routing_session(model, (n, t), replay=replay, strict=True) as s:
                logits = model(input_ids=seqs[:, :-1], use_cache=False).logits.float()
            logp = torch.zeros_like(rollout_logp)
            logp[:, 1:] = torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:].unsqueeze(-1)).squeeze(-1)
            mm = mismatch_metrics(logp, rollout_logp, resp)
            rm = routing_metrics(s, trace.truncate_tokens(t), replay)
            row[mode] = {"k3": mm["mismatch/k3"], "native_agreement": rm["routing/agreement"],
                         "replayed_agreement": rm.get("routing/replayed_agreement"),
                         "violations": rm.get("routing/violations")}
        out[preset] = row
        print(f"  {preset:12s} native agreement {row['none']['native_agreement']:.4f} | k3 none "
              f"{row['none']['k3']:.3e}  R3 {row['R3']['k3']:.3e} (ratio {row['R3']['k3'] / row['none']['k3']:.3f}) | "
              f"R3 replayed agreement {row['R3']['replayed_agreement']:.4f}, violations {row['R3']['violations']:.0f}")
    return out


def trainer_ab(cfg: ExperimentConfig, steps: int, threads: int) -> dict | None:
    try:
        from moerl.trainer.grpo import GRPOTrainer
    except ImportError as err:
        print(f"\ntrainer A/B skipped: moerl.trainer.grpo not importable ({err})")
        return None
    base = copy.deepcopy(cfg)
    base.warm_start.enabled = False
    base.threads = threads
    base.tracking.wandb_mode = "disabled"
    base.tracking.progress_bar = False
    base.trainer.eval_every = base.trainer.checkpoint_every = base.trainer.samples_every = 0
    none = copy.deepcopy(base)
    none.arm, none.replay.mode, none.rollout.capture_routing = "bench_none", "none", False
    none_diag = copy.deepcopy(base)
    none_diag.arm, none_diag.replay.mode, none_diag.rollout.capture_routing = "bench_none_diag", "none", True
    r3 = copy.deepcopy(base)
    r3.arm, r3.replay.mode, r3.rollout.capture_routing = "bench_r3", "R3", True
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {c.arm: GRPOTrainer(c, Path(tmp) / c.arm, progress=False) for c in (none, none_diag, r3)}
        metrics = {a: [] for a in trainers}
        for i in range(steps + 1):  # alternate arms step by step; the first round is a warm-up
            for arm, tr in trainers.items():
                m = tr.step()
                if i:
                    metrics[arm].append(m)
    out = {}
    print(f"\ntrainer A/B ({steps} steps per arm, alternated; warm start off):")
    for arm, ms in metrics.items():
        keys = [k for k in ms[0] if k.startswith("time/") or k in ("routing/agreement", "mismatch/k3",
                                                                    "replay/violations")]
        out[arm] = {k: statistics.median(float(m[k]) for m in ms) for k in keys}
        out[arm]["time/step_all"] = [float(m["time/step"]) for m in ms]
        print(f"  {arm:16s} " + "  ".join(f"{k}={v:.4g}" for k, v in out[arm].items() if not isinstance(v, list)))
    ref = out["bench_none"]["time/step"]
    for arm in ("bench_none_diag", "bench_r3"):
        out[arm]["overhead_pct_vs_bench_none"] = 100 * (out[arm]["time/step"] - ref) / ref
    spread = (max(out["bench_none"]["time/step_all"]) - min(out["bench_none"]["time/step_all"])) / ref
    out["noise_rel_bench_none"] = spread
    print(f"  R3 step vs none (no capture): {out['bench_r3']['overhead_pct_vs_bench_none']:+.2f}%   "
          f"none+capture/diagnostics vs none: {out['bench_none_diag']['overhead_pct_vs_bench_none']:+.2f}%   "
          f"(step-to-step spread of the none arm: {100 * spread:.1f}%)")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "experiments/00_tiny_moe_cpu/base.yaml"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trainer-steps", type=int, default=4)
    ap.add_argument("--no-trainer", action="store_true")
    ap.add_argument("--presets", default="qwen3_moe,deepseek_v3,mixtral",
                    help="presets for the agreement/k3 comparison ('' to skip)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the config's)")
    ap.add_argument("--out", default=str(ROOT / "results/replay"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config)
    threads = args.threads or cfg.threads
    torch.set_num_threads(threads)
    print("packed routing trace per token (L * k * ceil(log2 E) bits):")
    sizes(out)
    result = {"config": args.config, "preset": cfg.model.preset, "threads": threads,
              "torch": torch.__version__, "components": components(cfg, args.repeats)}
    if args.presets:
        result["mismatch_by_preset"] = mismatch_by_preset(cfg, args.presets.split(","))
    if not args.no_trainer:
        result["trainer"] = trainer_ab(cfg, args.trainer_steps, threads)
    (out / "overhead.json").write_text(json.dumps(result, indent=1))
    print(f"\nsaved {out / 'trace_sizes.json'} and {out / 'overhead.json'}")


if __name__ == "__main__":
    main()
