"""Pilot runs: the short single-seed runs that chose an experiment's regime before its grid, summarised
from their archived metrics (results/pilots/<NN>_<name>/metrics.jsonl.gz, or a live runs/pilots/<name>).

Experiment 05's pilot search (learning rate, mini-batches, run length, preset) and experiment 07's regime
pilots (where the fp32 control learns) each get their table here, and 05's the measures its README's
reading cites besides the table; scripts/write_readme_numbers.py writes both READMEs' sections from them.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import yaml

from moerl.analysis.collapse import collapse_step
from moerl.tracking import read_metrics

REWARD_BLOCK = 25  # steps per training-reward mean in 05's table
LAST_STEPS = 100  # "over the last 100 steps" in 05's reading of its 300-step pilots


def load_rows(run: Path) -> list[dict]:
    """A run directory's metrics rows: metrics.jsonl, or the gzipped copy kept in results/pilots."""
    if (run / "metrics.jsonl").exists():
        return read_metrics(run / "metrics.jsonl")
    with gzip.open(run / "metrics.jsonl.gz", "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def summarise(run: Path, name: str | None = None) -> dict:
    """One pilot of experiment 05: steps, training reward as 25-step means, run means of k3 and of the
    routing measures, grad-norm median / max, non-finite updates, collapse step, pass@1 at the first and
    last evaluation, and the measures its README's reading cites (R3's paired k3 cut, the last 100 steps'
    reward, the shares keeping a gradient)."""
    rows = load_rows(run)
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/pass1" in r]
    if not train:
        return {"run": name or run.name, "steps": 0}
    rewards = [r["reward/mean"] for r in train]

    def vals(key):
        return np.array([r[key] for r in train if isinstance(r.get(key), (int, float))], dtype=float)

    grad = vals("grad_norm")
    replay_cut = vals("replay_effect/k3_ratio")
    return {"run": name or run.name, "steps": len(train),
            "reward_blocks": [round(float(np.mean(rewards[i:i + REWARD_BLOCK])), 3)
                              for i in range(0, len(rewards), REWARD_BLOCK)],
            "k3_mean": float(np.nanmean(vals("mismatch/k3"))),
            "any_layer_differs": float(np.nanmean(vals("routing/any_layer_differs"))),
            "differing_layers_mean": float(np.nanmean(vals("routing/differing_layers_mean"))),
            "extreme_gt2": float(np.nanmean(vals("mismatch/extreme_gt2"))),
            "grad_norm_median": float(np.nanmedian(grad)), "grad_norm_max": float(np.nanmax(grad)),
            "nonfinite_updates": int(vals("updates/skipped_nonfinite").sum()),
            "collapse_step": collapse_step(rows),
            # the paired R3 pass's k3 cut (native / replayed) per checked batch: its median
            "replay_k3_cut": float(np.nanmedian(replay_cut)) if replay_cut.size else None,
            "reward_last": float(np.mean(rewards[-LAST_STEPS:])),
            "effective_seq_frac_min": float(np.nanmin(vals("effective/seq_frac"))),
            "effective_token_frac_mean": float(np.nanmean(vals("effective/token_frac"))),
            "pass1_initial": evals[0].get("eval/pass1") if evals else None,
            "pass1_final": evals[-1].get("eval/pass1") if evals else None}


def pilot_config(run: Path) -> str:
    """What a pilot ran, as its pilot.json names it (arm and keys), or its arm from config.yaml."""
    recorded = run / "pilot.json"
    if recorded.exists():
        return json.loads(recorded.read_text()).get("config", "—")
    cfg = run / "config.yaml"
    return (yaml.safe_load(cfg.read_text()) or {}).get("arm", "—") if cfg.exists() else "—"


def markdown_row(s: dict, config: str | None = None) -> str:
    blocks = " → ".join(f"{x:.2f}" for x in s["reward_blocks"])
    collapse = "—" if s["collapse_step"] is None else str(s["collapse_step"])
    return (f"| {s['run']} |{f' {config} |' if config is not None else ''} {s['steps']} | {blocks} | "
            f"{s['k3_mean']:.1e} | {s['any_layer_differs']:.3f} | "
            f"{s['grad_norm_median']:.2f} / {s['grad_norm_max']:.1f} | {collapse} | "
            f"{s['pass1_initial']:.3f} → {s['pass1_final']:.3f} |")


def search_table(dirs: list[Path]) -> list[str]:
    """Experiment 05's pilot table, one row per directory in the order given."""
    lines = ["| pilot | config | steps | reward | k3 | any-layer-differs | grad-norm median / max | collapse step | pass@1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in dirs:
        lines.append(markdown_row(summarise(run, _name(run)), pilot_config(run)))
    return lines


def _name(run: Path) -> str:
    return run.name.split("_", 1)[1] if run.name[:2].isdigit() and "_" in run.name else run.name


def search_facts(dirs: list[Path]) -> str:
    """The measures experiment 05's reading of its pilots cites that the table does not show: mean
    differing MoE layers per token, R3's paired k3 cut (median over checked batches), the DeepSeek-V3
    preset's k3 against Qwen3-MoE's at bf16, the last 100 steps' training reward of the 300-step pilots,
    and the shares of sequences and tokens keeping a gradient."""
    s = {_name(run): summarise(run, _name(run)) for run in dirs}
    lines = ["- mean MoE layers routed differently per token (run mean): " + ", ".join(
        f"{n} {v['differing_layers_mean']:.2f}" for n, v in s.items() if v["differing_layers_mean"] > 0)]
    cut = {n: v["replay_k3_cut"] for n, v in s.items() if v["replay_k3_cut"] and v["differing_layers_mean"] > 0}
    if cut:
        lines.append("- R3's paired k3 cut (native / replayed, median over checked batches): "
                     + ", ".join(f"{n} {c:.1f}×" for n, c in cut.items()))
    ds = next((v for n, v in s.items() if n.startswith("p11_ds_bf16")), None)
    qwen = next((v for n, v in s.items() if n.startswith("p1_bf16")), None)
    if ds and qwen:
        lines.append(f"- k3 at bf16, 100 steps: DeepSeek-V3 preset {ds['k3_mean']:.1e}, Qwen3-MoE {qwen['k3_mean']:.1e} "
                     f"({ds['k3_mean'] / qwen['k3_mean']:.0f}×)")
    long = {n: v for n, v in s.items() if v["steps"] >= 3 * LAST_STEPS}
    if long:
        lines.append(f"- training reward over the last {LAST_STEPS} steps: "
                     + ", ".join(f"{n} {v['reward_last']:.2f}" for n, v in long.items()))
    seq_min = min(v["effective_seq_frac_min"] for v in s.values())
    lines.append("- sequences keeping a gradient: " + ("every one, in every batch of every pilot" if seq_min == 1.0 else
                                                       f"at least {seq_min:.3f} of a batch")
                 + "; tokens, run means "
                 f"{min(v['effective_token_frac_mean'] for v in s.values()):.3f}–"
                 f"{max(v['effective_token_frac_mean'] for v in s.values()):.3f} (PPO clipping zeroes the rest)")
    return "\n".join(lines)


def regime_table(dirs: list[Path]) -> str:
    """Experiment 07's regime pilots (fp32 control under other learning rates and batch shapes): one row
    each, from the archived metrics and config of every directory given."""
    from moerl.analysis.dose import run_summary
    from moerl.analysis.dose_report import fmt

    lines = ["| pilot | warm start | LoRA experts | lr (warm-up) | prompts x samples | mini-batches | steps | "
             "training reward, 20-step means | held-out pass@1 (fp32 evaluator) by step | grad-norm max | collapse step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in dirs:
        rows = load_rows(run)
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        summary = run_summary(rows)
        train = [r["reward/mean"] for r in rows if "reward/mean" in r]
        blocks = " ".join(f"{sum(train[i:i + 20]) / len(train[i:i + 20]):.2f}" for i in range(0, len(train), 20))
        evals = ", ".join(f"{r['step']}: {r['eval/pass1']:.3f}" for r in rows if "eval/pass1" in r)
        t, ro = cfg["trainer"], cfg["rollout"]
        warmup = f" ({t['warmup_steps']})" if t.get("warmup_steps") else ""
        lines.append(f"| {run.name} | {cfg['warm_start']['steps']} | {cfg['lora']['expert_mode']} | {t['lr']:g}{warmup} | "
                     f"{ro['prompts_per_step']} x {ro['group_size']} | "
                     f"{t['mini_batches']} | {summary['steps']}/{t['steps']} | {blocks} | {evals} | "
                     f"{fmt(summary['grad_norm_max'], '.1f')} | {summary['collapse_step'] or '—'} |")
    return "\n".join(lines) + "\n"
