"""Write results/RESULTS.md: per experiment, one row per arm, mean ± std over seeds.

    python scripts/write_results.py results/runs/00_tiny_moe_cpu [more experiment dirs ...]
                                    [--out results/RESULTS.md] [--figures figures]

Each experiment directory becomes one section, in the order given.

For experiment 05 the section opens with its claims table (moerl.claims): the source's value,
this repository's value and whether it was reproduced. Columns: final held-out accuracy (greedy and pass@1 at T=1), mean k3 KL between rollout and
trainer, routing agreement, PPO clip fraction, masked token fraction, IS ratio p99, wall time per
run. The header names the commit(s) that produced the runs (their git_sha.txt), the machine(s)
they ran on (machine.json: bf16 numerics depend on the CPU's bf16 instructions, fp32 runs do not),
the total sweep wall time measured by scripts/sweep.py (sweep.json), and links the experiment's
figures (one per question of experiments/<name>/figures.yaml).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pandas as pd

from moerl import claims
from moerl.plots import load_questions
from moerl.results import MissingRunError, find_runs, load_metrics, load_sweep, mean_std, run_table, seed_stats

# (column in run_table, header, format, what it is)
COLUMNS = [
    ("final_eval/eval/greedy", "held-out acc. (greedy)", "{:.3f}", "accuracy on the held-out split after GRPO, greedy"),
    ("gain", "greedy gain", "{:+.3f}", "final minus initial held-out greedy accuracy (what GRPO added to the warm start)"),
    ("final_eval/eval/pass1", "held-out pass@1 (T=1)", "{:.3f}", "the same, one sample at temperature 1"),
    ("gain_pass1", "pass@1 gain", "{:+.3f}", "final minus initial held-out pass@1 at T=1 (the reward GRPO optimises)"),
    ("mean/mismatch/k3", "k3 KL", "{:.2e}",
     "token-mean k3 estimate of KL(pi_rollout || pi_old), mean over steps"),
    ("mean/routing/agreement", "routing agreement", "{:.4f}",
     "share of tokens whose trainer-native top-k equals the rollout's (all MoE layers), mean over steps"),
    ("mean/routing/replayed_agreement", "replayed agreement", "{:.4f}",
     "under R2/R3: share of replayed (token, layer) pairs whose experts equal the trace (n/a without replay)"),
    ("mean/clip/frac", "PPO clip frac.", "{:.4f}", "tokens whose PPO ratio was clipped (low or high)"),
    ("mean/mask/token_frac", "masked frac.", "{:.4f}", "tokens zeroed by MIS/IcePop (0 for other losses)"),
    ("mean/is/truncated_frac", "TIS trunc. frac.", "{:.4f}", "tokens whose TIS weight was truncated"),
    ("mean/is/p99", "IS ratio p99", "{:.3f}",
     "p99 of the raw importance ratio pi_old/pi_rollout at the loss's level, per step, mean over steps"),
    ("wall", "wall s/run", "{:.0f}",
     "seconds per run: the process time measured by the sweep (else the sum of time/step)"),
]


def arm_table(runs: pd.DataFrame) -> pd.DataFrame:
    runs = runs.copy()
    if {"final_eval/eval/greedy", "initial_eval/eval/greedy"} <= set(runs.columns):
        runs["gain"] = (pd.to_numeric(runs["final_eval/eval/greedy"], errors="coerce")
                        - pd.to_numeric(runs["initial_eval/eval/greedy"], errors="coerce"))
    if {"final_eval/eval/pass1", "initial_eval/eval/pass1"} <= set(runs.columns):
        runs["gain_pass1"] = (pd.to_numeric(runs["final_eval/eval/pass1"], errors="coerce")
                              - pd.to_numeric(runs["initial_eval/eval/pass1"], errors="coerce"))
    runs["wall"] = runs["wall/run_s"].where(runs["wall/run_s"].notna(), runs.get("wall/train_s"))
    return seed_stats(runs, [c for c, *_ in COLUMNS])


def render(exp_dir: Path, runs: pd.DataFrame, sweep: dict | None, figures: str | None) -> str:
    experiment = exp_dir.name
    stats = arm_table(runs)
    shas = sorted({s for s in runs["git_sha"].dropna()}) if "git_sha" in runs else []
    steps = sorted({int(s) for s in runs["steps"].dropna()}) if "steps" in runs else []
    seeds = runs.groupby("arm")["seed"].nunique()
    lines = [f"## {experiment}", "",
             f"- runs: {len(runs)} ({runs['arm'].nunique()} arms, {seeds.min()}-{seeds.max()} seeds per arm), "
             f"GRPO steps per run: {', '.join(map(str, steps)) or 'n/a'}",
             f"- produced by commit{'s' if len(shas) > 1 else ''}: " + (", ".join(f"`{s}`" for s in shas) or "unknown")
             + (" (a `-dirty` suffix: the tree had uncommitted changes)" if any(s.endswith("-dirty") for s in shas)
                else "")]
    if sweep and sweep.get("invocations"):
        inv = [i for i in sweep["invocations"] if i.get("ran")]
        first = inv[0] if inv else sweep["invocations"][0]
        lines.append(f"- total sweep wall time: {sweep.get('total_wall_seconds', 0) / 60:.1f} min "
                     f"over {len(inv)} invocation(s) of scripts/sweep.py "
                     f"({first.get('jobs')} runs at a time, {first.get('threads_per_job')} thread(s) each, "
                     f"{first.get('cores')} cores{', Ray' if first.get('ray') else ''})")
    else:
        lines.append("- total sweep wall time: not recorded (runs were not made by scripts/sweep.py)")
    lines.append(f"- machine: {machines(exp_dir)}")
    if figures:
        links = [f"[{q.name}]({figures}/{experiment}_{q.name}.png)" for q in load_questions(experiment)]
        links += [f"[accuracy]({figures}/{experiment}_accuracy.png)", f"[IS weights]({figures}/{experiment}_is_hist.png)"]
        lines += ["", f"![what each arm does to the mismatch]({figures}/{experiment}_summary.png)", "",
                  "Figures: " + ", ".join(links) + "."]
    if experiment == claims.EXPERIMENT:
        metrics = claims.finished(load_metrics(exp_dir.parent, experiment), runs)
        answered = claims.evaluate_claims(metrics, runs)
        lines += ["", "### The claims, answered from these runs", "",
                  "Computed by `moerl.claims` from the runs below (collapse by `moerl.collapse`; \"early\" / "
                  f"\"late\" = the first / last {claims.WINDOW} steps; ratios pair runs by seed and give the median "
                  "with the range over seeds). The verdict follows the rule in the last column.", "",
                  claims.claims_markdown(answered), "",
                  "Collapse step of each run (— : no collapse within the run):", "", claims.collapse_markdown(metrics)]
    lines += ["", "Mean ± std over seeds (std with ddof 1; a single value where only one seed finished).", ""]
    header = ["arm", "seeds"] + [h for _, h, _, _ in COLUMNS]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm in stats.index:
        cells = [arm, str(int(seeds.get(arm, 0)))]
        for col, _, fmt, _ in COLUMNS:
            if col in stats.columns.get_level_values(0):
                m, s, n = stats.loc[arm, (col, "mean")], stats.loc[arm, (col, "std")], stats.loc[arm, (col, "n")]
                cells.append(mean_std(m, s, int(n), fmt))
            else:
                cells.append("n/a")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Columns:", ""] + [f"- **{h}**: {d}" for _, h, _, d in COLUMNS] + [""]
    return "\n".join(lines)


def machines(exp_dir: Path) -> str:
    """The machines the runs of ``exp_dir`` recorded (machine.json), with how many runs each."""
    counts: dict[str, int] = {}
    missing = 0
    for key, run in find_runs(exp_dir.parent).items():
        if key.experiment != exp_dir.name:
            continue
        path = run / "machine.json"
        if not path.exists():
            missing += 1
            continue
        info = json.loads(path.read_text())
        isa = info.get("isa_flags") or {}
        flags = ", ".join(f for f in ("avx512_bf16", "amx_bf16") if isa.get(f))
        label = (f"{info.get('cpu_model', '?')} (bf16 ISA: {flags or 'none'}), torch {info.get('torch_version', '?')}, "
                 f"{info.get('torch_threads', '?')} thread(s)")
        counts[label] = counts.get(label, 0) + 1
    parts = [f"{label} — {n} run(s)" for label, n in counts.items()]
    if missing:
        parts.append(f"not recorded for {missing} run(s) (made before runs recorded their machine; their bf16 "
                     "figures may differ on a CPU with other bf16 kernels)")
    return "; ".join(parts) or "not recorded"


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment_dirs", nargs="+", help="e.g. results/runs/00_tiny_moe_cpu")
    ap.add_argument("--out", default="results/RESULTS.md")
    ap.add_argument("--figures", default="figures",
                    help="figure directory as linked from --out (relative to it); '' for no images")
    args = ap.parse_args(argv)
    sections = []
    for exp_dir in map(Path, args.experiment_dirs):
        try:
            runs = run_table(exp_dir.parent, exp_dir.name)
        except MissingRunError as err:
            sys.exit(f"write_results: {err}")
        sections.append(render(exp_dir, runs, load_sweep(exp_dir), args.figures or None))
    command = "python scripts/write_results.py " + " ".join(args.experiment_dirs)
    text = "\n".join([f"# Results", "", f"Written by `{command}` on {time.strftime('%Y-%m-%d')}.", ""] + sections)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
