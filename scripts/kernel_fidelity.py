"""Does the emulated bf16 rollout measure the same mismatch as the native one? Two levels, one command.

    .venv/bin/python scripts/kernel_fidelity.py [--tokens-only | --runs-only] [--out results/kernels]

1. **Tokens** (for each oneDNN ISA cap, in a child process): experiment 00's warm-started policy samples
   256 held-out prompts x 8 in fp32; the same sequences are then scored by three engines (fp32, native bf16,
   emulated bf16). Prints how far emulated and native bf16 logprobs are from each other and from fp32
   (median / p99 / max |difference|, share of tokens equal, k3 against fp32).
2. **Runs**: the runs of ``experiments/00_tiny_moe_cpu/kernels_fidelity.sh`` (baseline and r3, 3 seeds,
   1 thread) beside the recorded native ablation: per run k3 (median and mean over steps), the share of
   tokens with >= 1 re-routed layer, the per-layer flip rate and the share of tokens with ratio > 2
   (F(2)), then the mean and range over seeds per kernel; and whether the emulated runs under the AVX2
   cap repeat the emulated runs bit for bit.
Writes ``<out>/fidelity.json`` and ``<out>/fidelity.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

ARM = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"
# Run-level statistics, each a statistic of a run's per-step values, then summarised over seeds: k3 by its
# median (per-step k3 is heavy-tailed), the shares by their mean over steps (F(2) is 0 at most steps).
STATISTICS = {"k3 (run median)": ("mismatch/k3", "median"),
              "k3 (run mean)": ("mismatch/k3", "mean"),
              "tokens with >= 1 re-routed layer (run mean)": ("routing/any_layer_differs", "mean"),
              "per-layer flip rate (run mean)": ("routing/disagreement", "mean"),
              "F(2): tokens with ratio > 2 (run mean)": ("mismatch/extreme_gt2", "mean")}
SOURCES = {  # kernel setting -> (runs root, run-name suffix)
    "native": ("results/kernels/runs/native", ""),
    "emulated": ("results/kernels/runs/emulated", "+rollout.kernels=emulated"),
    "native, AVX2 cap": ("results/kernels/runs/native_avx2", "+rollout.kernels=native"),
    "emulated, AVX2 cap": ("results/kernels/runs/emulated_avx2", "+rollout.kernels=emulated"),
}
ARMS = ("baseline", "r3")
BF16_STEP_AT_ONE = 2.0 ** -7  # one bf16 step at magnitude 1: the resolution of a bf16 logit near 1
SEEDS = (0, 1, 2)


# -- 1. tokens ---------------------------------------------------------------------------------------
def token_child(prompts: int, group: int) -> dict:
    import torch

    from moerl.config import load_config
    from moerl.trainer.grpo import check_splits
    from moerl.rollout.hf import HFEngine
    from moerl.trainer.logprobs import forward_logprobs
    from moerl.trainer.warm_start import load_warm_start

    torch.set_num_threads(1)
    cfg = load_config(ARM, ["threads=1"])
    policy, tokenizer, _ = load_warm_start(cfg, progress=False)
    policy.eval()
    _, test_rows = check_splits(cfg)
    rows = test_rows[:prompts]
    sampler = HFEngine(policy, tokenizer, load_config(ARM, ["rollout.dtype=fp32"]).rollout, cfg.data.task)
    batch = sampler.generate([r["question"] for r in rows], [r["answer"] for r in rows], group, seed=0)
    mask = batch.response_mask
    with torch.no_grad():
        logp = {"fp32": forward_logprobs(policy, batch)[0]}
        for kernels in ("native", "emulated"):
            engine = HFEngine(policy, tokenizer, load_config(ARM, [f"rollout.kernels={kernels}"]).rollout,
                              cfg.data.task)
            with engine.kernels:
                logp[kernels] = forward_logprobs(engine.model, batch)[0]

    def diff(a, b) -> dict:
        d = (logp[a] - logp[b])[mask].double()
        q = d.abs().quantile(torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
        k3 = (d.exp() - 1 - d).mean().item()
        return {"median_abs": q[0], "p99_abs": q[1], "max_abs": d.abs().max().item(),
                "equal_frac": (d == 0).double().mean().item(), "k3": k3,
                "within_bf16_step_frac": (d.abs() <= BF16_STEP_AT_ONE).double().mean().item()}

    return {"isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or "default", "tokens": int(mask.sum()),
            "emulated_vs_native": diff("emulated", "native"), "native_vs_fp32": diff("native", "fp32"),
            "emulated_vs_fp32": diff("emulated", "fp32")}


def tokens(isas: list[str], prompts: int, group: int) -> list[dict]:
    out = []
    for isa in isas:
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        if isa != "default":
            env["ONEDNN_MAX_CPU_ISA"] = isa
        proc = subprocess.run([sys.executable, __file__, "--token-child", "--prompts", str(prompts),
                               "--group", str(group)], env=env, stdout=subprocess.PIPE, text=True, check=True)
        out += [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return out


# -- 2. runs -----------------------------------------------------------------------------------------
def run_statistics() -> dict:
    """{kernels: {arm: {statistic: [per-seed values]}}} from the runs that are there."""
    from moerl.analysis.results import MissingRunError, load_run

    out: dict = {}
    for source, (root, suffix) in SOURCES.items():
        for arm in ARMS:
            for seed in SEEDS:
                try:
                    run = load_run(root, "00_tiny_moe_cpu", arm + suffix, seed)
                except MissingRunError:
                    continue
                train = run[run["reward/mean"].notna()]
                values = out.setdefault(source, {}).setdefault(arm, {})
                for name, (key, stat) in STATISTICS.items():
                    values.setdefault(name, []).append(float(getattr(train[key], stat)()))
    return out


def bitwise(a_root: str, b_root: str, suffix: str) -> dict:
    """Per arm: seeds compared, and how many logged values (all but wall-clock times) differ."""
    from moerl.analysis.results import MissingRunError, load_run

    out = {}
    for arm in ARMS:
        compared, differing, trajectory_differs = 0, 0, 0
        for seed in SEEDS:
            try:
                a = load_run(a_root, "00_tiny_moe_cpu", arm + suffix, seed)
                b = load_run(b_root, "00_tiny_moe_cpu", arm + suffix, seed)
            except MissingRunError:
                continue
            keys = [k for k in a.columns if not k.startswith("time/") and not k.endswith("seconds") and k in b]
            a, b = a[keys].reset_index(drop=True), b[keys].reset_index(drop=True)
            same = (a == b) | (a.isna() & b.isna())
            compared += 1
            differing += int((~same).to_numpy().sum())
            trajectory = [k for k in keys if k.startswith(("reward/", "response/length", "routing/agreement"))]
            trajectory_differs += int((~same[trajectory]).to_numpy().sum())
        out[arm] = {"seeds": compared, "values_differing": differing, "trajectory_values_differing": trajectory_differs}
    return out


def fmt(values: list[float]) -> str:
    mean = sum(values) / len(values)
    return f"{mean:.3g} [{min(values):.3g}, {max(values):.3g}]" if len(values) > 1 else f"{mean:.3g}"


def markdown(token_rows: list[dict], stats: dict, reproduce: dict) -> str:
    lines = []
    if token_rows:
        lines += ["| ISA cap | tokens | emulated vs native: median / p99 / max abs Δlogp; equal; within 2^-7 | "
                  "native vs fp32: median / p99 / max, k3 | emulated vs fp32: median / p99 / max, k3 |",
                  "|---|---|---|---|---|"]
        for r in token_rows:
            e, n, f = r["emulated_vs_native"], r["native_vs_fp32"], r["emulated_vs_fp32"]
            lines.append(f"| {r['isa']} | {r['tokens']} | {e['median_abs']:.2e} / {e['p99_abs']:.2e} / "
                         f"{e['max_abs']:.2e}; {e['equal_frac']:.1%}; {e['within_bf16_step_frac']:.1%} | "
                         f"{n['median_abs']:.2e} / {n['p99_abs']:.2e} / "
                         f"{n['max_abs']:.2e}, {n['k3']:.2e} | {f['median_abs']:.2e} / {f['p99_abs']:.2e} / "
                         f"{f['max_abs']:.2e}, {f['k3']:.2e} |")
        lines.append("")
    if stats:
        sources = [s for s in SOURCES if s in stats]
        lines += ["| arm | statistic | " + " | ".join(sources) + " |", "|---|---|" + "---|" * len(sources)]
        for arm in ARMS:
            for name in STATISTICS:
                cells = [fmt(stats[s][arm][name]) if arm in stats[s] else "—" for s in sources]
                lines.append(f"| {arm} | {name} | " + " | ".join(cells) + " |")
        lines += ["", "mean over seeds [min, max] of each run's statistic over its 60 steps.", ""]
    for arm, r in reproduce.items():
        if r["seeds"]:
            lines.append(f"- emulated under the AVX2 cap vs emulated, {arm}: {r['seeds']} seeds, "
                         f"{r['values_differing']} logged values differ ({r['trajectory_values_differing']} of "
                         f"them rewards, lengths or routing agreement)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", default="default,AVX2")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens-only", action="store_true")
    ap.add_argument("--runs-only", action="store_true")
    ap.add_argument("--out", default="results/kernels")
    ap.add_argument("--token-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.token_child:
        print("RESULT " + json.dumps(token_child(args.prompts, args.group)), flush=True)
        return {}
    token_rows = [] if args.runs_only else tokens(args.isa.split(","), args.prompts, args.group)
    stats = {} if args.tokens_only else run_statistics()
    reproduce = {} if args.tokens_only else bitwise(SOURCES["emulated"][0], SOURCES["emulated, AVX2 cap"][0],
                                                    SOURCES["emulated"][1])
    text = markdown(token_rows, stats, reproduce)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"tokens": token_rows, "runs": stats, "emulated_avx2_vs_emulated": reproduce,
              "when": time.strftime("%Y-%m-%d %H:%M")}
    previous = json.loads((out / "fidelity.json").read_text()) if (out / "fidelity.json").exists() else {}
    for part in ("tokens", "runs", "emulated_avx2_vs_emulated"):  # a partial call keeps the other part
        if not result[part] and previous.get(part):
            result[part] = previous[part]
    (out / "fidelity.json").write_text(json.dumps(result, indent=1))
    (out / "fidelity.md").write_text(markdown(result["tokens"], result["runs"], result["emulated_avx2_vs_emulated"]))
    print(f"wrote {out / 'fidelity.json'} and {out / 'fidelity.md'}")
    return result


if __name__ == "__main__":
    main()
