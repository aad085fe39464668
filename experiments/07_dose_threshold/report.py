"""Experiment 07's tables and figure from its recorded runs: the dose ladder (one row per rung of the
uncorrected arm, the fp32 control first), the control's learning test, the threshold, and, where the main
grid has run, every mitigation arm per rung.

    .venv/bin/python experiments/07_dose_threshold/report.py [--runs results/runs] [--out results/07_dose_threshold]
    .venv/bin/python experiments/07_dose_threshold/report.py --pilots results/pilots/07_*   # the regime pilots

Writes ``<out>/ladder.md`` and ``<out>/ladder.json`` and draws ``results/figures/07_dose_ladder.png``
(one question: how do the mismatch and the held-out accuracy move with the dose?). Every number comes
from metrics.jsonl through moerl.dose; the rules are stated there.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from moerl.dose import control_learns, mismatch_order, run_summary, threshold  # noqa: E402
from moerl.tracking import read_metrics  # noqa: E402

EXPERIMENT = "07_dose_threshold"


def load_runs(root: Path) -> list[dict]:
    """Every run of the experiment: arm, rung (its rollout.dtype), seed and its summary."""
    runs = []
    for metrics in sorted((root / EXPERIMENT).glob("*/seed*/metrics.jsonl")):
        run = metrics.parent
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        summary = run_summary(read_metrics(metrics))
        if summary["steps"]:
            runs.append({"arm": cfg["arm"], "rung": cfg["rollout"]["dtype"], "seed": int(cfg["seed"]),
                         "steps_planned": cfg["trainer"]["steps"], **summary})
    return runs


def fmt(x, spec=".3f"):
    return "—" if x is None else format(x, spec)


def ladder_rows(runs: list[dict]) -> tuple[dict, dict | None]:
    """Seed-0 run of the uncorrected arm per rung (fp32: the control) and the control's seed-0 run."""
    control = next((r for r in runs if r["arm"] == "fp32_control" and r["seed"] == 0), None)
    ladder = {r["rung"]: r for r in runs if r["arm"] == "baseline" and r["seed"] == 0}
    if control is not None:
        ladder["fp32"] = control
    return ladder, control


def markdown(runs: list[dict]) -> str:
    ladder, control = ladder_rows(runs)
    lines = ["| rung | steps | k3 (run median) | tokens re-routed in >= 1 layer (run median) | F(2) (run median) | "
             "grad-norm median / max | training reward, first → last 25 steps | held-out pass@1 (fp32 evaluator), "
             "start → end | collapse step |", "|---|---|---|---|---|---|---|---|---|"]
    for rung in mismatch_order(ladder):
        s = ladder[rung]
        lines.append(f"| {rung}{' (control)' if rung == 'fp32' else ''} | {s['steps']}/{s['steps_planned']} | "
                     f"{fmt(s['k3_median'], '.2e')} | {fmt(s['any_layer_differs'])} | {fmt(s['extreme_gt2'], '.2e')} | "
                     f"{fmt(s['grad_norm_median'], '.2f')} / {fmt(s['grad_norm_max'], '.1f')} | "
                     f"{s['reward_first']:.3f} → {s['reward_last']:.3f} | {fmt(s['pass1_start'])} → "
                     f"{fmt(s['pass1_end'])} (step {s['pass1_end_step']}) | {s['collapse_step'] or '—'} |")
    controls = [r for r in runs if r["arm"] == "fp32_control"]
    lines += ["", "Control (fp32 rollout), every seed: " + ", ".join(
        f"seed {r['seed']}: pass@1 {fmt(r['pass1_start'])} → {fmt(r['pass1_end'])} at step {r['pass1_end_step']}"
        f" ({'learns' if control_learns(r) else 'does not learn'} by the rule)" for r in sorted(controls, key=lambda r: r["seed"]))]
    finished = control is not None and all(r["steps"] == r["steps_planned"] for r in ladder.values())
    found = threshold(ladder, control) if control is not None else None
    lines.append("Threshold (lowest rung in mismatch order whose uncorrected run collapses while the control "
                 f"learns): **{found or 'none'}**" + ("" if finished else " — the ladder is not complete yet"))
    return "\n".join(lines) + "\n"


def figure(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ladder, control = ladder_rows(runs)
    order = mismatch_order(ladder)
    fig, (ax_k3, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = range(len(order))
    ax_k3.semilogy(x, [max(ladder[r]["k3_median"] or 1e-16, 1e-16) for r in order], "o-", color="tab:red")
    ax_k3.set_ylabel("k3 KL, run median (log)")
    ax_k3.set_title("mismatch given by each rung")
    for r_i, r in zip(x, order):
        s = ladder[r]
        gain = (s["pass1_end"] or 0) - (s["pass1_start"] or 0)
        ax_acc.bar(r_i, gain, color="tab:gray" if r == "fp32" else "tab:blue")
        if s["collapse_step"] is not None:
            ax_acc.annotate(f"collapsed\nstep {s['collapse_step']}", (r_i, gain), ha="center", va="bottom", fontsize=8)
    if control is not None:
        ax_acc.axhline(0.10, ls="--", color="k", lw=0.8)
        ax_acc.text(len(order) - 0.5, 0.10, "control must gain ≥ 0.10", ha="right", va="bottom", fontsize=8)
    ax_acc.axhline(0, color="k", lw=0.5)
    ax_acc.set_ylabel("held-out pass@1 gain (fp32 evaluator)")
    ax_acc.set_title("what training did at each rung (seed 0)")
    for ax in (ax_k3, ax_acc):
        ax.set_xticks(list(x), [f"{r}\n(control)" if r == "fp32" else r for r in order])
        ax.set_xlabel("rollout precision, ordered by measured mismatch")
    fig.suptitle("Experiment 07: dose ladder, uncorrected arm (1 seed per rung)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pilot_rows(dirs: list[Path]) -> str:
    """The regime pilots (fp32 control under other learning rates and batch shapes): one row each, from
    the archived metrics (``metrics.jsonl.gz``) and config of every directory given."""
    import gzip

    lines = ["| pilot | warm start | LoRA experts | lr (warm-up) | prompts x samples | mini-batches | steps | "
             "training reward, 20-step means | held-out pass@1 (fp32 evaluator) by step | grad-norm max | collapse step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in dirs:
        with gzip.open(run / "metrics.jsonl.gz", "rt") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="results/runs")
    ap.add_argument("--out", default="results/07_dose_threshold")
    ap.add_argument("--figure", default="results/figures/07_dose_ladder.png")
    ap.add_argument("--pilots", nargs="*", help="archived regime pilots (results/pilots/07_*): print their table")
    args = ap.parse_args()
    if args.pilots:
        print(pilot_rows([Path(p) for p in args.pilots]))
        return
    runs = load_runs(Path(args.runs))
    if not runs:
        sys.exit(f"report: no runs of {EXPERIMENT} under {args.runs} (run experiments/07_dose_threshold/launch.sh pilot)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(runs)
    (out / "ladder.md").write_text(text)
    (out / "ladder.json").write_text(json.dumps(runs, indent=1) + "\n")
    figure(runs, Path(args.figure))
    print(text + f"wrote {out / 'ladder.md'}, {out / 'ladder.json'}, {args.figure}")


if __name__ == "__main__":
    main()
