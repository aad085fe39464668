"""Experiment 06 on a GPU: the Qwen3-30B-A3B routing geometry with trained routers at hidden 256 -> 2048,
the bf16 rollout on the GPU's own kernels against the fp32 trainer, within a time guard (--budget-s, 480 s).

    python scripts/gpu_width_geometry.py --out OUT_DIR                   # on one CUDA GPU (experiment 06's README)
    python scripts/gpu_width_geometry.py --device cpu --smoke --out DIR  # CI-sized: every part on the CPU
    python scripts/gpu_width_geometry.py --figure-only --out results/geometry/gpu   # redraw from the points
    python scripts/gpu_width_geometry.py --out "$OUT" --widths 256 --sft-steps 400 --sft-seed 1   # another SFT

Each point is the Qwen3-30B-A3B routing (48 MoE layers x 128 experts, top-8, ``moerl.models.geometry``) at
hidden H with the CPU width ladder's heads (H/32 of 32, H/64 key/value heads) and expert FFN min(H/2, cap).
The CPU ladder's H/2 cannot reach hidden 2048 (39 B parameters); the cap keeps the AdamW state (fp32
weights, gradients and two moments: 16 bytes a parameter) within the card: ``--expert-ffn-cap auto`` takes
the largest of 128 / 64 / 32 whose widest point fits in 70 % of the GPU's memory (128 on an H200: 5.4 B
parameters, 87 GB at hidden 2048; 64 on an H100: 3.0 B, 48 GB), one cap for the whole ladder, named in
every point.

Per point: the supervised warm start of the CPU's ``state_qwen3_warm400_h*`` points (``warm_start.*`` of
experiment 06's base config at 400 steps x 32 samples, AdamW lr 2e-3 one-cycle, fp32), trained on the GPU
and kept in memory (``moerl.trainer.warm_start.supervised_warm_start``); then experiment 06's measurement
(``moerl.analysis.routing_geometry.measure``): the bf16 engine (``rollout.kernels=native``: cuBLAS,
FlashAttention and the grouped-GEMM experts in bf16) samples 16 prompts x 8 and the fp32 trainer (TF32
off) scores the same tokens routing natively and replaying the rollout's experts (R3). The JSON of each
point is written as it lands, with the GPU's name, the torch / CUDA versions and the wall times.

Time: ``--budget-s`` (default 480) from the start. ``--sft-steps auto`` first times a few SFT steps at
the widest point and takes the largest of 400 / 300 / 200 / 100 steps that lets every point fit (fewer
than 400 is named in the points: ``gpu_qwen3_warm200_...``); before each point the guard skips it when
the time left is below the previous point's wall time (points run widest first, so that is an upper
bound). The figure is redrawn after every point; a run stopped from outside keeps what had landed.

``--sft-seed N`` trains the SFT from other initial weights and another batch order on the same data: the
spread between SFTs, beside which a difference between devices (or widths) is read. Its points are named
``..._sft<N>`` and drawn without a line, hollow, in their ladder's colour.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure_geometry  # noqa: E402 - the CPU ladder's config, point spec and record format

from moerl.config import ExperimentConfig, ModelConfig, load_config  # noqa: E402
from moerl.models.geometry import geometry_model_config  # noqa: E402

log = logging.getLogger("gpu_width_geometry")

WIDTHS = (2048, 1024, 512, 256)  # widest first: each point's wall time bounds the next one's
FFN_CAPS = (128, 64, 32)
ADAMW_BYTES_PER_PARAMETER = 16  # fp32 weight, gradient and AdamW's two moments
MEMORY_SHARE = 0.7  # of the card's memory for the AdamW state; the rest holds activations and engine copies
SFT_BATCH = 32
SFT_STEPS = 400  # the CPU's state_qwen3_warm400_h* points
STEP_CHOICES = (400, 300, 200, 100)
POINT_OVERHEAD_S = 30.0  # build, evaluation and measurement per point, beside the SFT (planning only)
PLAN_MARGIN = 1.15
CALIBRATION_STEPS = (2, 5)  # untimed warm-up steps, timed steps
SFT_LOG_EVERY_S = 30.0  # a point cut off by the call's time limit still shows how far its SFT got
FIGURE = "gpu_width_share.png"
RUN_RECORD = "run.json"  # not a point: point files are gpu_*.json

SMOKE_OVERRIDES = ["rollout.group_size=2", "rollout.max_new_tokens=6", "data.train_size=64", "data.test_size=8"]
SMOKE = dict(widths=(64, 32), ffn_cap=16, step_choices=(3, 2), sft_batch=4, prompts=2)


class DeviceUnavailable(SystemExit):
    """The device asked for is not there: one line, before anything is written."""


def resolve_device(name: str, smoke: bool) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"gpu_width_geometry: --device {name} asked for, but torch {torch.__version__} sees no CUDA device "
            f"(built with CUDA {torch.version.cuda}); run it on a GPU, or pass --device cpu --smoke")
    if device.type == "cpu" and not smoke:
        raise DeviceUnavailable("gpu_width_geometry: the full ladder (48 x 128 experts up to hidden 2048) is GPU "
                                "work; on a CPU pass --smoke, or use scripts/measure_geometry.py for the CPU ladder")
    if device.type not in ("cpu", "cuda"):
        raise DeviceUnavailable(f"gpu_width_geometry: --device {name}: expected cuda, cuda:N or cpu")
    return device


def expert_ffn(hidden: int, cap: int) -> int:
    """The CPU width ladder's expert FFN (hidden / 2), capped."""
    return min(hidden // 2, cap)


def model_config(hidden: int, ffn: int, smoke: bool = False) -> ModelConfig:
    """The Qwen3-30B-A3B routing at ``hidden`` (heads as the CPU width ladder sets them); a 2-layer,
    8-expert top-2 stand-in for ``smoke``."""
    width = dict(hidden_size=hidden, moe_intermediate_size=ffn, num_heads=max(hidden // 32, 1),
                 num_kv_heads=max(hidden // 64, 1), head_dim=32)
    if smoke:
        return ModelConfig(preset="qwen3_moe", num_layers=2, num_experts=8, top_k=2, **width)
    return geometry_model_config("qwen3_30b_a3b", **width)


def parameter_count(cfg: ModelConfig, tokenizer) -> int:
    """Parameters of the model ``cfg`` builds, counted on the meta device (nothing allocated)."""
    from moerl.models.presets import build_model

    return sum(p.numel() for p in build_model(cfg, tokenizer, device="meta").parameters())


def fit_ffn_cap(widths, memory_bytes: float, tokenizer, caps=FFN_CAPS, smoke: bool = False) -> int:
    """The largest cap whose widest point's AdamW state fits in ``MEMORY_SHARE`` of ``memory_bytes``
    (the smallest cap when none does; the memory guard then skips what cannot fit)."""
    widest = max(widths)
    for cap in caps:
        params = parameter_count(model_config(widest, expert_ffn(widest, cap), smoke), tokenizer)
        if params * ADAMW_BYTES_PER_PARAMETER <= MEMORY_SHARE * memory_bytes:
            return cap
    return caps[-1]


def choose_sft_steps(seconds_per_step: float, points: int, seconds_left: float, choices=STEP_CHOICES,
                     overhead_s: float = POINT_OVERHEAD_S, margin: float = PLAN_MARGIN) -> int:
    """The most SFT steps (of ``choices``) with which ``points`` points fit in ``seconds_left``, each
    costing ``steps x seconds_per_step x margin + overhead_s``; the fewest when none fits."""
    for steps in sorted(choices, reverse=True):
        if points * (steps * seconds_per_step * margin + overhead_s) <= seconds_left:
            return steps
    return min(choices)


def skip_reason(need_bytes: float, memory_bytes: float, estimate_s: float | None, left_s: float) -> str | None:
    """Why a point is not started: its AdamW state exceeds the card's share, or its estimated wall time
    (the previous point's, or the plan's for the first) exceeds the time left; None to run it."""
    if need_bytes > MEMORY_SHARE * memory_bytes:
        return f"memory: AdamW state {need_bytes / 1e9:.1f} GB > {MEMORY_SHARE:.0%} of {memory_bytes / 1e9:.1f} GB"
    if estimate_s is not None and estimate_s > left_s:
        return f"time: needs ~{estimate_s:.0f} s, {max(left_s, 0):.0f} s left"
    return None


def point_name(hidden: int, ffn: int, steps: int, smoke: bool, sft_seed: int | None = None) -> str:
    return (f"gpu_{'smoke' if smoke else 'qwen3'}_warm{steps}_h{hidden}_f{ffn}"
            + ("" if sft_seed is None else f"_sft{sft_seed}"))


def point_config(base: ExperimentConfig, model: ModelConfig, steps: int, batch: int) -> ExperimentConfig:
    return dataclasses.replace(base, model=model,
                               warm_start=dataclasses.replace(base.warm_start, steps=steps, batch_size=batch))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return float(psutil.virtual_memory().total)


def environment(device: torch.device) -> dict:
    """What the numbers were computed with: the device, its software and the matmul precision flags."""
    import peft
    import transformers

    env = {"type": device.type, "torch": torch.__version__, "transformers": transformers.__version__,
           "peft": peft.__version__, "python": platform.python_version(),
           "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(name=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)),
                   memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count,
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32, tf32_cudnn=torch.backends.cudnn.allow_tf32,
                   bf16_reduced_precision_reduction=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    else:
        env.update(name="CPU", processor=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def seconds_per_sft_step(cfg: ExperimentConfig, device: torch.device, tokenizer, rows) -> float:
    """Wall seconds of one warm-start SFT step of ``cfg`` on ``device`` (the warm start's own step, model and
    optimiser), from a few steps after a warm-up."""
    import random

    from moerl.models.presets import build_model
    from moerl.trainer.warm_start import sft_batch, sft_optimizer, sft_step

    warmup, timed = CALIBRATION_STEPS
    model = build_model(cfg.model, tokenizer, seed=cfg.data.seed, device=device)
    model.config.output_router_logits = True
    opt, sched = sft_optimizer(model, cfg)
    rng = random.Random(cfg.data.seed)
    start = 0.0
    for i in range(warmup + timed):
        if i == warmup:
            synchronize(device)
            start = time.perf_counter()
        batch = sft_batch(rng.sample(rows, cfg.warm_start.batch_size), tokenizer, cfg.data.task)
        sft_step(model, opt, sched, *(t.to(device) for t in batch))
    synchronize(device)
    per_step = (time.perf_counter() - start) / timed
    del model, opt, sched
    free(device)
    return per_step


def run_point(name: str, cfg: ExperimentConfig, device: torch.device, rows, prompts: int, extra: dict,
              sft_seed: int | None = None) -> dict:
    """Warm start and measure one point; the record scripts/measure_geometry.py writes, plus the device.
    ``sft_seed``: the SFT's initial weights and batch order from this seed instead of the data seed."""
    from moerl.analysis.routing_geometry import measure
    from moerl.tracking import git_sha
    from moerl.trainer.warm_start import supervised_warm_start

    point = measure_geometry.Point(
        name, ("gpu_width",), cfg.model, state="warm",
        warm_start={"steps": cfg.warm_start.steps, "batch_size": cfg.warm_start.batch_size},
        note=f"48 MoE layers x 128, top-8, hidden {cfg.model.hidden_size}, expert FFN "
             f"{cfg.model.moe_intermediate_size} after a {cfg.warm_start.steps}-step SFT"
             f"{'' if sft_seed is None else f' (SFT seed {sft_seed})'}, on {extra['device']['name']}")
    spec = measure_geometry.spec(point, prompts, cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    policy, tokenizer, meta = supervised_warm_start(cfg, progress=False, device=device, log_every_s=SFT_LOG_EVERY_S,
                                                    init_seed=sft_seed)
    synchronize(device)
    policy_seconds = time.perf_counter() - start
    results = {"bf16": measure(policy, tokenizer, cfg, rows[:prompts], dtype="bf16", seed=point.seed)}
    synchronize(device)
    r = results["bf16"]
    log.info("%s: p_mean %.4f  >=1-layer share %.4f [%.4f, %.4f]  independence %.4f  k3 %.2e -> R3 %.2e", name,
             r["all/p_mean"], r["all/share"], r["all/share_lo"], r["all/share_hi"], r["all/independence"],
             r["native/k3"], r["r3/k3"])
    record = {"spec": spec, "spec_hash": measure_geometry.spec_hash(spec),
              "policy": {"state": "warm", "warm_start": {k: meta.get(k) for k in
                                                         ("key", "steps", "test_accuracy", "train_seconds",
                                                          "init_seed")}},
              "results": results, "seconds_total": time.perf_counter() - start, "seconds_policy": policy_seconds,
              "threads": torch.get_num_threads(), "git_sha": git_sha(),
              "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
              **extra}
    del policy
    free(device)
    return record


def write_json(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    tmp.replace(path)


def draw_figure(out: Path, cpu_points: Path, smoke: bool = False) -> Path | None:
    """The share-vs-width figure from the GPU points under ``out`` and the CPU points under ``cpu_points``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from moerl.analysis.geometry_report import figure_gpu_width, load_points

    try:
        cpu = load_points(cpu_points)
    except FileNotFoundError:
        log.warning("no CPU points under %s: the figure shows the GPU's alone", cpu_points)
        cpu = pd.DataFrame(columns=["point", "ladders", "state", "rollout", "seed", "family", "H", "F", "share",
                                    "share_lo", "share_hi"])
    try:
        gpu = load_points(out, pattern="gpu_*.json")
    except FileNotFoundError:
        gpu = pd.DataFrame()
    fig = figure_gpu_width(cpu, gpu, note=" (smoke run: tiny stand-in geometry, not a result)" if smoke else "")
    path = out / FIGURE
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    started = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu with --smoke")
    ap.add_argument("--out", default="results/geometry/gpu", help="where the point JSONs and the figure go ($OUT)")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="hidden sizes, run in this order")
    ap.add_argument("--expert-ffn-cap", default="auto", help="auto, or the cap of the expert FFN (hidden/2 below it)")
    ap.add_argument("--sft-steps", default="auto", help="auto (400 when the budget allows), or a number")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall seconds from the start for the whole run")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per point (each sampled group_size times)")
    ap.add_argument("--cpu-points", default="results/geometry", help="the CPU ladder's point JSONs (the figure)")
    ap.add_argument("--sft-seed", type=int, default=None,
                    help="seed of the SFT's initial weights and batch order (default: the data seed); the data "
                         "stay the same: a second SFT, for the spread between SFTs; points named ..._sft<N>")
    ap.add_argument("--smoke", action="store_true", help="tiny widths and steps, every part on the CPU (CI)")
    ap.add_argument("--figure-only", action="store_true", help="redraw the figure from the points under --out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    if args.figure_only:
        if not list(out.glob("gpu_*.json")):
            raise SystemExit(f"gpu_width_geometry: no point JSONs (gpu_*.json) under {out} to draw")
        print(draw_figure(out, Path(args.cpu_points), smoke=any(out.glob("gpu_smoke_*.json"))))
        return 0
    try:
        widths = [int(w) for w in args.widths.split(",")]
        cap = None if args.expert_ffn_cap == "auto" else int(args.expert_ffn_cap)
        fixed_steps = None if args.sft_steps == "auto" else int(args.sft_steps)
    except ValueError as err:
        raise SystemExit(f"gpu_width_geometry: --widths / --expert-ffn-cap / --sft-steps: {err}") from None
    bad = [w for w in widths if w < 64 or w % 64]
    if bad and not args.smoke:
        raise SystemExit(f"gpu_width_geometry: --widths {args.widths}: {bad[0]} is not a multiple of 64 (heads of 32, "
                         f"key/value heads hidden/64)")
    if cap is not None and (cap < 8 or cap % 8):
        raise SystemExit(f"gpu_width_geometry: --expert-ffn-cap {cap}: expected a multiple of 8 (grouped-GEMM strides)")
    if args.sft_seed is not None and args.sft_seed < 0:
        raise SystemExit(f"gpu_width_geometry: --sft-seed {args.sft_seed}: expected a seed >= 0")
    if fixed_steps is not None and fixed_steps < 1:
        raise SystemExit(f"gpu_width_geometry: --sft-steps {fixed_steps}: expected a positive number or auto")
    device = resolve_device(args.device, args.smoke)
    if device.type == "cuda":  # the trainer is fp32: no TF32 products
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    else:
        torch.set_num_threads(1)

    from moerl.data import load_splits
    from moerl.data.tokenizer import build_tokenizer

    smoke = args.smoke
    overrides = (SMOKE_OVERRIDES if smoke else []) + ["rollout.kernels=native"]
    base = load_config(measure_geometry.BASE_CONFIG, overrides)
    if smoke:
        widths, cap = list(SMOKE["widths"]), SMOKE["ffn_cap"]
    choices = SMOKE["step_choices"] if smoke else STEP_CHOICES
    batch = SMOKE["sft_batch"] if smoke else SFT_BATCH
    prompts = SMOKE["prompts"] if smoke else args.prompts
    tokenizer = build_tokenizer()
    train_rows, test_rows = load_splits(base.data)
    memory = device_memory(device)
    cap = cap or fit_ffn_cap(widths, memory, tokenizer, smoke=smoke)
    env = environment(device)
    out.mkdir(parents=True, exist_ok=True)
    run = {"device": env, "widths": widths, "expert_ffn_cap": cap, "budget_s": args.budget_s, "sft_seed": args.sft_seed,
           "points": [],
           "skipped": [], "argv": list(argv if argv is not None else sys.argv[1:])}
    log.info("device %s (%s), expert FFN cap %d, widths %s", env["name"], device, cap, widths)

    widest = max(widths)
    widest_cfg = point_config(base, model_config(widest, expert_ffn(widest, cap), smoke),
                              max(*choices, sum(CALIBRATION_STEPS)), batch)
    estimate = None  # the next point's wall seconds: the plan's, then the previous (wider) point's
    if fixed_steps is None:
        per_step = seconds_per_sft_step(widest_cfg, device, tokenizer, train_rows)
        left = args.budget_s - (time.perf_counter() - started)
        steps = choose_sft_steps(per_step, len(widths), left, choices=choices)
        estimate = steps * per_step * PLAN_MARGIN + POINT_OVERHEAD_S
        run["calibration"] = {"seconds_per_sft_step_at_widest": per_step, "seconds_left": left, "chosen": steps,
                              "choices": list(choices), "overhead_s": POINT_OVERHEAD_S, "margin": PLAN_MARGIN}
        log.info("calibration: %.3f s per SFT step at hidden %d; %d steps for %d points in %.0f s", per_step, widest,
                 steps, len(widths), left)
    else:
        steps = fixed_steps
    run["sft_steps"] = steps
    write_json(out / RUN_RECORD, run)

    for hidden in widths:
        ffn = expert_ffn(hidden, cap)
        cfg = point_config(base, model_config(hidden, ffn, smoke), steps, batch)
        name = point_name(hidden, ffn, steps, smoke, args.sft_seed)
        params = parameter_count(cfg.model, tokenizer)
        need = params * ADAMW_BYTES_PER_PARAMETER
        left = args.budget_s - (time.perf_counter() - started)
        reason = skip_reason(need, memory, estimate, left)
        if reason:
            log.warning("%s skipped (%s)", name, reason)
            run["skipped"].append({"name": name, "reason": reason})
            write_json(out / RUN_RECORD, run)
            continue
        log.info("%s: %.2f B parameters, AdamW state ~%.1f GB; %.0f s left", name, params / 1e9, need / 1e9, left)
        extra = {"device": env, "parameters": params, "adamw_bytes_estimate": need, "expert_ffn_cap": cap,
                 "sft_steps_choice": run.get("calibration", {"fixed": steps})}
        try:
            record = run_point(name, cfg, device, test_rows, prompts, extra, sft_seed=args.sft_seed)
        except torch.OutOfMemoryError as err:  # the estimate missed: the narrower points may still fit
            reason = f"out of memory: {' '.join(str(err).split())[:200]}"
        if reason:
            log.warning("%s failed (%s)", name, reason)
            run["skipped"].append({"name": name, "reason": reason})
            write_json(out / RUN_RECORD, run)
            free(device)
            continue
        write_json(out / f"{name}.json", record)
        estimate = record["seconds_total"]
        run["points"].append({"name": name, "seconds": estimate, "share": record["results"]["bf16"]["all/share"]})
        write_json(out / RUN_RECORD, run)
        draw_figure(out, Path(args.cpu_points), smoke)
    run["seconds_total"] = time.perf_counter() - started
    write_json(out / RUN_RECORD, run)
    draw_figure(out, Path(args.cpu_points), smoke)
    print(f"\n{'point':34s} {'share [95% CI]':>24s} {'p_mean':>7s} {'indep':>6s} {'k3':>9s} {'k3 R3':>9s} {'s':>5s}")
    for p in run["points"]:
        r = json.loads((out / f"{p['name']}.json").read_text())["results"]["bf16"]
        print(f"{p['name']:34s} {r['all/share']:.4f} [{r['all/share_lo']:.4f}, {r['all/share_hi']:.4f}] "
              f"{r['all/p_mean']:7.4f} {r['all/independence']:6.4f} {r['native/k3']:9.2e} {r['r3/k3']:9.2e} "
              f"{p['seconds']:5.0f}")
    for s in run["skipped"]:
        print(f"{s['name']:34s} skipped: {s['reason']}")
    print(f"device: {env['name']}; {run['seconds_total']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
