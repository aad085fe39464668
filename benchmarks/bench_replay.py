"""Router Replay benchmark: packed trace sizes, and replay overhead against the same arm without replay.

    .venv/bin/python benchmarks/bench_replay.py [--config experiments/00_tiny_moe_cpu/base.yaml]
        [--repeats 5] [--trainer-steps 4] [--no-trainer] [--out DIR | --record]
    .venv/bin/python benchmarks/bench_replay.py --instructions [--arm-config ...arms/baseline.yaml]

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
3. ``--instructions``: the overhead as instruction counts (valgrind callgrind), which a busy CPU does
   not disturb. One process per arm of ``--arm-config`` (default: the baseline arm of experiment 00):
   ``none`` (replay.mode=none, rollout.capture_routing=false), ``capture`` (capture only) and ``r3``
   (replay.mode=R3). Each runs the same warm-up steps (``--warmup-steps``, with R3 so that every code
   path has run once), so all arms reach the measured step with the same weights, prompts and sampling
   seed; then that one step is counted, region by region (instructions). Capture = capture arm -
   none arm, replay = r3 arm - capture arm, each without the routing diagnostics (routing agreement,
   divergence, the R3 agreement alarm, ``trainer.paired_replay_every``'s extra pass, logging their
   metrics), which are reported on their own line. ``--instructions-repeats`` extra runs of the none
   arm give the method's resolution. Takes ~25 min per run on a 2-core CPU. -> overhead.json
   ``instructions``; the other modes keep the file's other keys.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from moerl.bench_output import add_output_args, output_dir  # noqa: E402
from moerl.config import ExperimentConfig, load_config, resolved_threads  # noqa: E402
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


# -- instruction counts (callgrind) -----------------------------------------------------------------
# The arms of the comparison: (rollout.capture_routing, replay.mode).
INSTRUCTION_ARMS = {"none": (False, "none"), "capture": (True, "none"), "r3": (True, "R3")}
# Regions of a step that are routing *diagnostics*, not capture or replay: the trainer's agreement and
# divergence metrics against the rollout's trace, the R3 agreement alarm, the paired pass of
# trainer.paired_replay_every (all in consequence_metrics), and logging the extra metrics.
DIAGNOSTIC_REGIONS = ("routing_metrics", "consequence_metrics", "log")
# Marked inside the step (label -> where): functions of the capture/replay path, to show where a
# difference between arms comes from. Timer phases (rollout, old_logprob, ...) are marked as well.
FUNCTION_REGIONS = {
    "capture_hook": ("moerl.replay.capture", "GenerationRecorder", "policy"),
    "capture_to_trace": ("moerl.replay.capture", "GenerationRecorder", "to_trace"),
    "session_policy": ("moerl.replay.session", "RoutingSession", "policy"),
    "session_check": ("moerl.replay.session", "RoutingSession", "check"),
    "session_to_trace": ("moerl.replay.session", "RoutingSession", "to_trace"),
    "trace_build": ("moerl.replay.trace", "RoutingTrace", "__post_init__"),
    "trace_cat": ("moerl.replay.trace", "RoutingTrace", "cat"),
    "replay_gate_weights": ("moerl.models.routers", "SoftmaxTopK", "gate_weights"),
    "replay_gate_weights_ds": ("moerl.models.routers", "SigmoidGroupLimited", "gate_weights"),
    "replay_collapse": ("moerl.models.routers", None, "collapse_repeated"),
    "routing_metrics": ("moerl.trainer.grpo", None, "routing_metrics"),
}
# Matrix-multiply kernels (BLAS GEMM/GEMV, torch's own bf16 dot products and GEMM loops, flash attention).
# Valgrind's virtual CPU has no AVX-512/AMX, so the bf16 engine's matmuls run torch's AVX2 fallback
# there and take most of a counted step, far more than they do natively: the counts are also reported
# against the step without these kernels, an upper bound on the overhead's share on any CPU.
MATMUL_KERNELS = re.compile(r"gemm|gemv|bf16_dot|mkl_blas|flash_attention|brgemm|dnnl|baddbmm", re.I)
OPERATIONAL = ["threads=1", "tracking.wandb_mode=disabled", "tracking.progress_bar=false", "trainer.eval_every=0",
               "trainer.checkpoint_every=0", "trainer.samples_every=0"]


def _set_arm(trainer, arm: str) -> None:
    # The engine holds the same RolloutConfig object as trainer.cfg.rollout: one assignment serves both.
    trainer.cfg.rollout.capture_routing, trainer.cfg.replay.mode = INSTRUCTION_ARMS[arm]
    assert trainer.engine.cfg is trainer.cfg.rollout


def _mark_regions(regions, trainer) -> None:
    """Wrap the step's phases and the capture/replay functions so each closes a region of its own."""
    import functools
    import importlib
    from contextlib import contextmanager

    from moerl.trainer import grpo

    stack = ["step_other"]

    @contextmanager
    def region(label):
        # A nested region is labelled with its path ("routing_metrics/trace_build"): work done inside a
        # diagnostic stays attributed to that diagnostic.
        regions.mark(stack[-1])  # what ran before, in the enclosing region
        stack.append(label if len(stack) == 1 else f"{stack[-1]}/{label}")
        try:
            yield
        finally:
            regions.mark(stack.pop())

    def calibrate(calls: int = 50) -> None:
        """Wrapped calls of an empty function: all they count is the markers' cost, filed under ``marker``."""
        regions.mark(stack[-1])
        stack.append("marker")
        noop = wrap(lambda: None, "call")
        for _ in range(calls):
            noop()
        stack.pop()

    region.calibrate = calibrate

    def wrap(fn, label):
        @functools.wraps(fn)
        def marked(*args, **kwargs):
            with region(label):
                return fn(*args, **kwargs)
        return marked

    timer_call = grpo.Timer.__call__

    @contextmanager
    def timed(self, name):
        with region(name), timer_call(self, name):
            yield

    grpo.Timer.__call__ = timed
    for label, (module_name, cls_name, attr) in FUNCTION_REGIONS.items():
        owner = importlib.import_module(module_name)
        if cls_name is not None:
            owner = getattr(owner, cls_name)
        raw = owner.__dict__[attr]
        if isinstance(raw, classmethod):
            setattr(owner, attr, classmethod(wrap(raw.__func__, label)))
        else:
            setattr(owner, attr, wrap(raw, label))
    trainer.tracker.log = wrap(trainer.tracker.log, "log")
    return region


def instructions_child(arm_config: str, arm: str, warmup_steps: int, overrides: list[str], out_json: Path) -> None:
    """One arm, run under callgrind by ``instructions``: warm-up, then one counted step."""
    import gc
    import hashlib

    from instructions import Regions
    from moerl.trainer.grpo import GRPOTrainer

    cfg = load_config(arm_config, OPERATIONAL + overrides)
    regions = Regions()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = GRPOTrainer(cfg, tmp, progress=False)
        for _ in range(warmup_steps):  # the same in every arm: identical weights at the counted step
            _set_arm(trainer, "r3")
            trainer.step()
        _set_arm(trainer, arm)
        seen = {}
        generate = trainer.engine.generate

        def generate_and_hash(*args, **kwargs):
            batch = generate(*args, **kwargs)
            seen["rollout_sha"] = hashlib.sha256(batch.input_ids.numpy().tobytes()).hexdigest()[:16]
            return batch

        trainer.engine.generate = generate_and_hash
        region = _mark_regions(regions, trainer)
        # As timeit does: no collection inside the counted step, where it would fall at a different
        # moment in each arm (they allocate differently) and cost millions of instructions at once.
        gc.collect()
        gc.disable()
        regions.start()
        metrics = trainer.step()
        gc.enable()
        # Cost of the markers themselves: the parent takes it out of the step.
        region.calibrate()
        regions.stop("marker")
    keys = ("reward/mean", "response/length_mean", "mismatch/k3", "routing/agreement", "replay/violations",
            "replay/checked_rows", "routing/replayed_agreement")
    out_json.write_text(json.dumps({
        "arm": arm, "capture_routing": cfg.rollout.capture_routing, "under_callgrind": regions.under_callgrind,
        "paired_replay_every": cfg.trainer.paired_replay_every, "step": metrics["step"], **seen,
        "metrics": {k: float(metrics[k]) for k in keys if k in metrics}, "marks": len(regions.labels)}))


def _region_totals(out_prefix: Path) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(instructions per label, marks per label, matmul-kernel instructions per label) of one child's
    callgrind dumps."""
    from instructions import function_costs, read_dump, region_dumps

    totals, counts, matmul = {}, {}, {}
    for path in region_dumps(out_prefix):
        label, ir = read_dump(path)
        totals[label] = totals.get(label, 0) + ir
        counts[label] = counts.get(label, 0) + 1
        mm = sum(v for fn, v in function_costs(path).items() if MATMUL_KERNELS.search(fn))
        matmul[label] = matmul.get(label, 0) + mm
    return totals, counts, matmul


def instructions(arm_config: str, warmup_steps: int, repeats: int, overrides: list[str], work: Path,
                 reuse: bool = False) -> dict:
    """Count one step of each arm under callgrind (one process each) and split the differences.
    ``reuse``: summarise the dumps a previous run left in ``work`` instead of counting again."""
    import os
    import subprocess

    from instructions import available, callgrind_command
    from moerl.trainer.warm_start import warm_start_dir

    missing = available()
    if missing:
        raise SystemExit(f"--instructions needs valgrind's callgrind: {missing}")
    cfg = load_config(arm_config, OPERATIONAL + overrides)
    if cfg.warm_start.enabled and not (ROOT / warm_start_dir(cfg)).exists():
        raise SystemExit(f"no warm-start checkpoint at {warm_start_dir(cfg)}: run scripts/warm_start.py first "
                         f"(training it under valgrind would take hours), or pass warm_start.enabled=false")
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT / "src")}
    runs = [("none", 0), ("capture", 0), ("r3", 0)] + [("none", i) for i in range(1, repeats + 1)]
    results = {}
    for arm, rep in runs:
        name = f"{arm}_{rep}"
        prefix = work / f"cg_{name}"
        info = work / f"{name}.json"
        start = time.perf_counter()
        if not reuse:
            for old in work.glob(prefix.name + ".*"):
                old.unlink()
            cmd = callgrind_command(prefix) + [
                sys.executable, str(Path(__file__).resolve()), "--instructions-arm", arm, "--arm-config", arm_config,
                "--warmup-steps", str(warmup_steps), "--instructions-info", str(info),
                *(["--"] + overrides if overrides else [])]
            with open(work / f"{name}.log", "w") as log:
                done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            if done.returncode:
                raise SystemExit(f"arm {arm} failed under callgrind (exit {done.returncode}); "
                                 f"see {work / (name + '.log')}")
        elif not info.exists():
            if rep:
                break  # fewer repeats were counted than asked for
            raise SystemExit(f"--instructions-reuse: no counts for arm {arm} in {work}")
        totals, counts, matmul = _region_totals(prefix)
        meta = json.loads(info.read_text())
        step = {k: v for k, v in totals.items() if k.split("/")[0] != "marker"}
        marker = sum(v for k, v in totals.items() if k not in step) / sum(v for k, v in counts.items() if k not in step)
        # The markers' own instructions (a ctypes call and a client request each), spread over the
        # regions; the arms differ in how many marks they make, so their cost is taken out of the totals.
        markers = sum(counts[k] for k in step) * marker
        results[name] = {**meta, "regions": step, "calls": counts, "marker_instructions": round(markers),
                         "total": sum(step.values()) - round(markers),
                         "matmul_regions": {k: v for k, v in matmul.items() if k in step},
                         "matmul_total": sum(v for k, v in matmul.items() if k in step),
                         "instructions_per_mark": marker}
        if not reuse:
            results[name]["wall_s"] = time.perf_counter() - start
        print(f"  {name:10s} {results[name]['total'] / 1e9:9.4f} G instructions in the step "
              f"({'reused' if reuse else f'{time.perf_counter() - start:.0f} s under callgrind'}; "
              f"rollout {meta.get('rollout_sha')})", flush=True)
    return summarise_instructions(results, arm_config, warmup_steps)


def summarise_instructions(results: dict, arm_config: str, warmup_steps: int) -> dict:
    """Overheads in % of the none arm's step, with the method's resolution."""
    def diag(r, key="regions"):
        return sum(v for k, v in r[key].items() if k.split("/")[0] in DIAGNOSTIC_REGIONS)

    def without_diag(r, key="regions"):
        markers = r["marker_instructions"] if key == "regions" else 0
        return sum(r[key].values()) - diag(r, key) - markers

    none, cap, r3 = results["none_0"], results["capture_0"], results["r3_0"]
    base = none["total"]
    base_nomm = base - none["matmul_total"]  # the step without matrix-multiply kernels
    same_rollout = len({r.get("rollout_sha") for r in (none, cap, r3)}) == 1
    capture = without_diag(cap) - without_diag(none)
    replay = without_diag(r3) - without_diag(cap)
    diagnostics = diag(r3) - diag(none)
    # Matmul-kernel instructions in the differences: replay changes how many tokens each expert gets.
    capture_mm = without_diag(cap, "matmul_regions") - without_diag(none, "matmul_regions")
    replay_mm = without_diag(r3, "matmul_regions") - without_diag(cap, "matmul_regions")
    # Resolution: how far two counts of the same work differ: repeated none-arm processes, and regions
    # doing the same work in several arms (the refit moves the same tensors in all three; the rollout,
    # capture included, is the same in the capture and r3 arms; rewards and bookkeeping, outside the
    # timed phases, are the same in all three). Counts of the same Python code differ between arms by
    # up to ~0.1 %, as the interpreter's method cache hits differently after different code ran.
    repeats = [abs(r["total"] - base) for k, r in results.items() if k.startswith("none_") and k != "none_0"]
    def phase(r, name):
        return sum(v for k, v in r["regions"].items() if k.split("/")[0] == name)

    same_work = {"refit": [none, cap, r3], "rollout": [cap, r3], "step_other": [none, cap, r3]}
    spread = {name: max(phase(r, name) for r in rs) - min(phase(r, name) for r in rs) for name, rs in same_work.items()}
    resolution = max(repeats + list(spread.values()))
    labels = sorted(set().union(*(r["regions"] for r in (none, cap, r3))), key=lambda k: -r3["regions"].get(k, 0))
    per_region = {k: {a: r["regions"].get(k, 0) for a, r in (("none", none), ("capture", cap), ("r3", r3))}
                  for k in labels}
    pct = lambda x: 100 * x / base  # noqa: E731
    pct_nomm = lambda x: 100 * x / base_nomm  # noqa: E731
    both = capture + replay
    both_nomm = both - capture_mm - replay_mm
    out = {"method": "callgrind instruction counts (Ir) of one GRPO step per arm, after identical warm-up",
           "arm_config": arm_config, "warmup_steps": warmup_steps, "same_rollout_tokens": same_rollout,
           "step_instructions_none": base, "step_matmul_instructions_none": none["matmul_total"],
           "capture_instructions": capture, "replay_instructions": replay, "diagnostics_instructions": diagnostics,
           "capture_matmul_instructions": capture_mm, "replay_matmul_instructions": replay_mm,
           "capture_pct": pct(capture), "replay_pct": pct(replay), "total_pct": pct(both),
           "diagnostics_pct": pct(diagnostics), "resolution_pct": pct(resolution),
           "resolution_detail_instructions": {"repeated_none_runs": repeats,
                                              **{f"same_work_{k}": v for k, v in spread.items()}},
           # Against the step without matmul kernels (numerators without their matmul differences too):
           # as if every matmul were free, an upper bound on the share on any CPU.
           "vs_step_without_matmul": {"capture_pct": pct_nomm(capture - capture_mm),
                                      "replay_pct": pct_nomm(replay - replay_mm), "total_pct": pct_nomm(both_nomm),
                                      "resolution_pct": pct_nomm(resolution)},
           "target_pct": 2.0, "target_met": pct(both) + pct(resolution) <= 2.0,
           "target_met_vs_step_without_matmul": pct_nomm(both_nomm) + pct_nomm(resolution) <= 2.0,
           "per_region": per_region, "runs": results}
    print(f"\ninstruction counts, one step of {arm_config} after {warmup_steps} identical warm-up step(s)"
          f"{'' if same_rollout else ' (WARNING: the arms sampled different tokens)'}:")
    print(f"  {'region':24s} {'none':>14s} {'capture':>14s} {'r3':>14s}   (instructions)")
    for k, v in per_region.items():
        print(f"  {k:24s} {v['none']:14,d} {v['capture']:14,d} {v['r3']:14,d}")
    print(f"  step (none arm) {base:,d} instructions, {100 * none['matmul_total'] / base:.1f} % of them in matmul "
          f"kernels (valgrind's CPU has no AVX-512/AMX: the bf16 engine's matmuls run an AVX2 fallback)")
    nomm = out["vs_step_without_matmul"]
    print(f"  {'':9s} {'% of the counted step':>22s} {'% of it without matmuls':>24s}")
    for name, a, b in (("capture", pct(capture), nomm["capture_pct"]), ("replay", pct(replay), nomm["replay_pct"]),
                       ("both", pct(both), nomm["total_pct"]),
                       ("+-resol.", pct(resolution), nomm["resolution_pct"])):
        print(f"  {name:9s} {a:+21.3f}% {b:+23.3f}%")
    print("  capture = capture arm - none arm, replay = r3 arm - capture arm, routing diagnostics excluded: "
          f"they add {pct(diagnostics):+.3f} % (agreement/divergence metrics"
          f"{', the paired replay pass' if r3['paired_replay_every'] else ''}, logging them)")
    print("  resolution: the largest difference between two counts of the same work ("
          + ", ".join(f"{k} {v:,d}" for k, v in out["resolution_detail_instructions"].items()
                      if not isinstance(v, list))
          + (f", repeated none runs {', '.join(f'{x:,d}' for x in repeats)}" if repeats else ", no repeated run")
          + " instructions)")
    print(f"  target capture + replay <= 2 % of a step: counted step {'MET' if out['target_met'] else 'NOT MET'} "
          f"({pct(both):.3f} % +- {pct(resolution):.3f} %); against the step without matmuls "
          f"{'MET' if out['target_met_vs_step_without_matmul'] else 'NOT MET'} "
          f"({nomm['total_pct']:.3f} % +- {nomm['resolution_pct']:.3f} %)")
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
    add_output_args(ap, "results/replay")
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions of one step per arm under callgrind (see 3. above) and exit")
    ap.add_argument("--arm-config", default="experiments/00_tiny_moe_cpu/arms/baseline.yaml",
                    help="--instructions: the arm whose step is counted (relative to the repo root)")
    ap.add_argument("--warmup-steps", type=int, default=1, help="--instructions: steps before the counted one")
    ap.add_argument("--instructions-repeats", type=int, default=1,
                    help="--instructions: extra runs of the none arm, for the method's resolution")
    ap.add_argument("--instructions-reuse", action="store_true",
                    help="--instructions: summarise the dumps of a previous --instructions run in OUT/callgrind")
    ap.add_argument("--instructions-arm", choices=sorted(INSTRUCTION_ARMS), help=argparse.SUPPRESS)
    ap.add_argument("--instructions-info", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="--instructions: config overrides key=value (after --)")
    args = ap.parse_args(argv)
    if args.instructions_arm:  # a child of --instructions, running under callgrind
        instructions_child(args.arm_config, args.instructions_arm, args.warmup_steps, args.overrides,
                           Path(args.instructions_info))
        return
    out = output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    previous = json.loads((out / "overhead.json").read_text()) if (out / "overhead.json").exists() else {}
    if args.instructions:
        torch.set_num_threads(1)
        print("instruction counts under callgrind, one process per arm (~25 min each on a 2-core CPU):")
        counted = instructions(args.arm_config, args.warmup_steps, args.instructions_repeats, args.overrides,
                               out / "callgrind", reuse=args.instructions_reuse)
        counted["when"] = time.strftime("%Y-%m-%d %H:%M")
        (out / "overhead.json").write_text(json.dumps({**previous, "instructions": counted}, indent=1))
        print(f"\nsaved {out / 'overhead.json'} (key 'instructions'; dumps and logs in {out / 'callgrind'})")
        return
    cfg = load_config(args.config)
    threads = args.threads or resolved_threads(cfg)
    torch.set_num_threads(threads)
    print("packed routing trace per token (L * k * ceil(log2 E) bits):")
    sizes(out)
    result = {"config": args.config, "preset": cfg.model.preset, "threads": threads,
              "torch": torch.__version__, "components": components(cfg, args.repeats)}
    if args.presets:
        result["mismatch_by_preset"] = mismatch_by_preset(cfg, args.presets.split(","))
    if not args.no_trainer:
        result["trainer"] = trainer_ab(cfg, args.trainer_steps, threads)
    if "instructions" in previous:  # written by --instructions; this mode does not remeasure it
        result["instructions"] = previous["instructions"]
    (out / "overhead.json").write_text(json.dumps(result, indent=1))
    print(f"\nsaved {out / 'trace_sizes.json'} and {out / 'overhead.json'}")


if __name__ == "__main__":
    main()
