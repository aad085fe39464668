"""Fill the generated sections of the README, the experiment READMEs, docs/rollout_kernels.md and
docs/benchmarks.md from the
recorded results, so no number there is typed by hand or goes stale: the prose around a section cites it
(tests/test_readme_numbers.py holds the prose to that).

    python scripts/write_readme_numbers.py            # rewrite every generated section in place
    python scripts/write_readme_numbers.py --check    # exit 1 naming each section whose text differs

A section is the text between ``<!-- generated:NAME begin (scripts/write_readme_numbers.py) -->`` and
``<!-- generated:NAME end -->``; everything outside the markers is prose and is left alone. Sources:
results/runs/<experiment> (summaries, metrics, sweep.json) through moerl.analysis, results/geometry
for 06, results/pilots for the pilot tables, results/warm_start, results/kernels and results/peer, and the
benchmarks' JSON files (results/step, results/refit, results/replay, results/bench).
tests/test_readme_numbers.py runs --check, so a README that drifts from its results fails.
"""
from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
WRITER = "scripts/write_readme_numbers.py"


def _f(x, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


# -- the experiment table -------------------------------------------------------------------------
# (directory, question, runs on, smallest command, results link). The time column is measured: the
# recorded sweep's wall time (sweep.json) or, for 06, the sum of its points' seconds.
EXPERIMENTS = [
    ("00_tiny_moe_cpu", "does router replay shrink the mismatch; what do the loss corrections act on?", "CPU",
     "experiments/00_tiny_moe_cpu/launch.sh --smoke", "[RESULTS](results/RESULTS.md#00_tiny_moe_cpu)"),
    ("01_kimi_k2_lora_grpo", "Kimi-K2 (1T) LoRA GRPO at scale, no replay", "8 × 8 GPUs",
     "experiments/01_kimi_k2_lora_grpo/launch.sh --dry-run", "not executed (no GPU cluster)"),
    ("02_kimi_k2_lora_grpo_r3", "the same with R3", "8 × 8 GPUs",
     "experiments/02_kimi_k2_lora_grpo_r3/launch.sh --dry-run", "not executed (no GPU cluster)"),
    ("03_qwen3_30b_a3b_lora_mitigations", "which mitigation, on Qwen3-30B-A3B", "8 GPUs",
     "experiments/03_qwen3_30b_a3b_lora_mitigations/launch.sh --arm r3 --dry-run", "not executed (no GPU cluster)"),
    ("04_moonlight_16b_a3b_r3", "R3 with the dense-first-layer mapping", "8 GPUs",
     "experiments/04_moonlight_16b_a3b_r3/launch.sh --dry-run", "not executed (no GPU cluster)"),
    ("05_mismatch_consequences", "do the papers' claims (collapse, failing corrections, broken R3) hold?", "CPU",
     "experiments/05_mismatch_consequences/launch.sh --smoke", "[RESULTS](results/RESULTS.md#05_mismatch_consequences)"),
    ("06_routing_geometry", "is the re-routed share a matter of depth, width and router state?",
     "CPU (+ 1 GPU)",
     "experiments/06_routing_geometry/run.sh --smoke", "[RESULTS](results/RESULTS.md#06_routing_geometry)"),
    ("07_dose_threshold", "at what rollout precision does GRPO collapse; which mitigation moves it?", "CPU",
     "experiments/07_dose_threshold/launch.sh --smoke", "[RESULTS](results/RESULTS.md#07_dose_threshold)"),
    ("08_real_moe", "your checkpoint: mismatch per layer, LoRA GRPO", "1 GPU", "experiments/08_real_moe/launch.sh --smoke",
     "not executed"),
]


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.1f} min"


def recorded_runs(runs_dir: Path) -> tuple[int, float]:
    """(finished runs, their run time summed) under an experiment's recorded runs: every run directory with
    a summary.json, each timed by its logged step and evaluation times. Read from the runs themselves, not
    from sweep.json, whose entries a grid that outlives a session may lack (a sweep killed at a session's
    end recorded nothing before its entries were written run by run)."""
    from moerl.tracking import logged_seconds, read_metrics

    finished = sorted(runs_dir.glob("*/seed*/summary.json"))
    seconds = sum(logged_seconds(read_metrics(summary.parent / "metrics.jsonl")) for summary in finished)
    return len(finished), seconds


def section_experiments(results: Path) -> str:
    import json

    lines = ["| experiment | question | runs on | recorded runs, run time summed | smallest command | results |",
             "|---|---|---|---|---|---|"]
    for name, question, where, command, link in EXPERIMENTS:
        n_runs, seconds = recorded_runs(results / "runs" / name)
        if n_runs:
            time = f"{n_runs} runs, {_hours(seconds)}"
        elif name == "06_routing_geometry":
            points = [json.loads(p.read_text()) for p in sorted((results / "geometry").glob("*.json"))]
            points = [p for p in points if "seconds_total" in p]
            time = f"{len(points)} points, {_hours(sum(p['seconds_total'] for p in points))}"
        else:
            time = "—"
        readme = f"[{name}](experiments/{name}/README.md)"
        lines.append(f"| {readme} | {question} | {where} | {time} | `{command}` | {link} |")
    return "\n".join(lines)


# -- experiment 00 ---------------------------------------------------------------------------------
ARMS_00 = ["fp32_rollout", "baseline", "r2", "r3", "tis", "geo_mis_3pct", "icepop", "deepseek_baseline", "deepseek_r3"]


def section_00(runs_root: Path) -> str:
    from moerl.analysis.results import load_sweep, run_table
    from moerl.analysis.results_tables import family_ratio_cells

    exp = "00_tiny_moe_cpu"
    runs = run_table(runs_root, exp)
    ratios = family_ratio_cells(runs)
    per_arm = runs.assign(k3=pd.to_numeric(runs["median/mismatch/k3"], errors="coerce"),
                          p0=pd.to_numeric(runs["initial_eval/eval/pass1"], errors="coerce"),
                          p1=pd.to_numeric(runs["final_eval/eval/pass1"], errors="coerce"),
                          agree=pd.to_numeric(runs["mean/routing/all_layers_agree"], errors="coerce"))
    lines = ["| arm | k3, run median (mean of seeds) | k3 ÷ its family's baseline, same seed | tokens routed alike in "
             "every MoE layer | held-out pass@1 (own engine), step 0 → end |", "|---|---|---|---|---|"]
    for arm in ARMS_00:
        a = per_arm[per_arm["arm"] == arm]
        if a.empty:
            continue
        lines.append(f"| {arm} | {_f(a['k3'].mean(), '.2e')} | {ratios.get(arm, '—')} | {_f(a['agree'].mean(), '.4f')} | "
                     f"{_f(a['p0'].mean(), '.3f')} → {_f(a['p1'].mean(), '.3f')} |")
    sweep = load_sweep(runs_root / exp) or {}
    ran = [i for i in sweep.get("invocations", []) if i.get("ran")]
    n_runs, n_arms, seeds = len(runs), runs["arm"].nunique(), runs.groupby("arm")["seed"].nunique().max()
    steps = sorted({int(s) for s in runs["steps"].dropna()})
    wall = (f"; the sweep took {sweep['total_wall_seconds'] / 60:.1f} min of wall time "
            f"({ran[0]['jobs']} runs at a time, {ran[0]['threads_per_job']} thread(s) each, {ran[0]['cores']} cores)"
            if ran and sweep.get("total_wall_seconds") else "")
    lines += ["", f"{n_runs} runs ({n_arms} arms x {seeds} seeds, {', '.join(map(str, steps))} GRPO steps each){wall}. "
              "Mean over seeds; the ratio is the median over seeds (range in brackets)."]
    return "\n".join(lines)


def section_00_setup(results: Path) -> str:
    """Experiment 00's model size and warm start, read from the cached warm start its config names."""
    import json

    from safetensors import safe_open

    from moerl.config import load_config
    from moerl.trainer.warm_start import warm_start_key

    cfg = load_config(REPO / "experiments/00_tiny_moe_cpu/arms/baseline.yaml", [])
    path = results / "warm_start" / warm_start_key(cfg)
    meta = json.loads((path / "meta.json").read_text())
    with safe_open(str(path / "model.safetensors"), framework="numpy") as weights:
        params = sum(int(np.prod(weights.get_slice(name).get_shape())) for name in weights.keys())
    acc = meta["test_accuracy"]
    return (f"{params / 1e6:.1f} M parameters; warm start `{meta['key']}` ({meta['steps']} SFT steps): held-out "
            f"pass@1 {100 * acc['pass1']:.1f} % at T = 1, greedy {100 * acc['greedy']:.1f} %.")


# -- the rollout kernels (docs/rollout_kernels.md) ---------------------------------------------------
def section_kernels_fidelity(results: Path) -> str:
    """scripts/kernel_fidelity.py's own table (results/kernels/fidelity.md), verbatim."""
    return (results / "kernels" / "fidelity.md").read_text().strip()


def section_kernels_speed(results: Path) -> str:
    """benchmarks/bench_kernels.py's medians (results/kernels/bench_kernels.json): native against emulated
    bf16, the fp32 trainer as the floor, per ISA."""
    import json

    bench = json.loads((results / "kernels" / "bench_kernels.json").read_text())
    lines = ["| ISA | rollout native → emulated (fp32 floor) | ratio | GRPO step native → emulated (fp32 floor) | ratio |",
             "|---|---|---|---|---|"]
    for r in bench["results"]:
        m = r["medians"]
        cells = []
        for key in ("time/rollout", "time/wall"):
            cells += [f"{m['native'][key]:.3f} → {m['emulated'][key]:.3f} s ({m['fp32'][key]:.3f})",
                      f"{m['native'][key] / m['emulated'][key]:.2f}×"]
        lines.append(f"| {'AVX2 cap' if r['isa'] == 'AVX2' else 'this CPU (' + r['isa'] + ')'} | {' | '.join(cells)} |")
    return "\n".join(lines + ["", f"{bench['results'][0]['rounds']} timed rounds per side, "
                               f"{bench['results'][0]['threads']} thread, recorded {bench.get('when', '?')}."])


def section_kernels_peer(results: Path) -> str:
    """benchmarks/bench_peer.py at one thread (results/peer/threads1*): moerl's step time over TRL's
    GRPOTrainer per structure, as each recorded file states it, with the moerl step's rollout share."""
    import json

    lines = ["| recording | ISA | moerl / TRL, per structure | moerl's rollout / step (medians) | recorded |",
             "|---|---|---|---|---|"]
    for path in sorted((results / "peer").glob("threads1*/bench_peer.json")):
        bench = json.loads(path.read_text())
        ratios = ", ".join(f"{name} {v['ratio']:.2f}" for name, v in sorted(bench["structures"].items()))
        phases = bench.get("moerl_phase_medians") or {}
        share = (f"{phases['time/rollout']:.2f} of {phases['time/step']:.2f} s"
                 if "time/rollout" in phases and "time/step" in phases else "—")
        isa = "AVX2 cap" if "avx2" in path.parent.name else "this CPU"
        lines.append(f"| `{path.parent.name}` | {isa} | {ratios} | {share} | {bench.get('when', '?')} |")
    return "\n".join(lines)


# -- the benchmarks (docs/benchmarks.md) -------------------------------------------------------------
def section_benchmarks(results: Path) -> str:
    """Each benchmark's latest recorded figure from the JSON its script wrote (moerl.analysis.benchmark_records)."""
    from moerl.analysis import benchmark_records

    return benchmark_records.latest_table(results)


# -- experiment 05 ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)  # three sections read the same runs; cleared at each main()
def _runs_05(runs_root: Path):
    from moerl.analysis import claims
    from moerl.analysis.results import load_metrics, run_table

    runs = run_table(runs_root, claims.EXPERIMENT)
    metrics = claims.finished(load_metrics(runs_root, claims.EXPERIMENT), runs)
    return metrics, runs, claims.evaluate_claims(metrics, runs)


def section_05(runs_root: Path) -> str:
    lines = ["| claim | source | reproduced |", "|---|---|---|"]
    for c in _runs_05(runs_root)[2]:
        lines.append(f"| {c.claim} | {c.source} | **{c.verdict}** |")
    return "\n".join(lines)


def section_05_claims(runs_root: Path) -> str:
    """Each claim with this repository's values and verdict (RESULTS.md has the rules and registration)."""
    lines = ["| claim | this repo (CPU scale) | reproduced |", "|---|---|---|"]
    for c in _runs_05(runs_root)[2]:
        lines.append(f"| {c.claim} | {c.repo} | **{c.verdict}** |")
    return "\n".join(lines)


def section_05_facts(runs_root: Path) -> str:
    """claims.facts_markdown, and the grid's budget: its sweeps' wall time (sweep.json) and each run's own
    logged step and evaluation times."""
    import json

    from moerl.analysis import claims
    from moerl.tracking import logged_seconds, read_metrics

    runs_dir = runs_root / claims.EXPERIMENT
    seconds = [logged_seconds(read_metrics(summary.parent / "metrics.jsonl"))
               for summary in sorted(runs_dir.glob("*/seed*/summary.json"))]
    sweep = json.loads((runs_dir / "sweep.json").read_text()) if (runs_dir / "sweep.json").exists() else {}
    ran = [i for i in sweep.get("invocations", []) if i.get("ran")]
    budget = (f"- budget: {len(seconds)} runs, {np.median(seconds):.0f} s each by their logged times (median; "
              f"{min(seconds):.0f}–{max(seconds):.0f} s), {sum(seconds) / 3600:.1f} h in all, "
              f"{len(seconds) * np.median(seconds) / 2 / 3600:.1f} h two at a time at the median"
              + (f"; the sweeps took {sweep.get('total_wall_seconds', 0) / 60:.0f} min of wall time over {len(ran)} "
                 f"invocations ({ran[0].get('jobs')} runs at a time, {ran[0].get('threads_per_job')} thread each)"
                 if ran else ""))
    return "\n".join([claims.facts_markdown(_runs_05(runs_root)[0]), budget])


# Experiment 05's pilots in the order its README reads them: lr 1e-3, then lr 3e-4 / 5e-4 and mini-batches
# with their controls, the DeepSeek-V3 preset, the 300-step runs; any other archived pilot follows.
PILOT_ORDER_05 = ("p4", "p5", "p1", "p2", "p3", "p9", "p10", "p7", "p8", "p11", "p12", "p13", "p15", "p16")


def _pilots_05(pilots: Path) -> list[Path]:
    rank = {p: i for i, p in enumerate(PILOT_ORDER_05)}
    return sorted(pilots.glob("05_p*"), key=lambda d: (rank.get(d.name.split("_")[1], len(rank)), d.name))


def section_05_pilots(pilots: Path) -> str:
    from moerl.analysis.pilots import search_table
    return "\n".join(search_table(_pilots_05(pilots)))


def section_05_pilot_facts(pilots: Path) -> str:
    from moerl.analysis.pilots import search_facts
    return search_facts(_pilots_05(pilots))



# -- experiment 06 ---------------------------------------------------------------------------------
def section_06(geometry: Path) -> str:
    from moerl.analysis import geometry_claims
    from moerl.analysis.geometry_report import load_points, predictions

    df = load_points(geometry)
    exp05 = geometry_claims.experiment_05_share(geometry.parent / "runs" / "05_mismatch_consequences" / "baseline")
    rows = [line for line in geometry_claims.claims_lines(df, predictions(df), exp05)[2:]]
    lines = ["| claim | paper | verdict |", "|---|---|---|"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        lines.append(f"| {cells[0]} | {cells[1]} | {cells[3]} |")
    return "\n".join(lines)


def _geometry_timing(geometry: Path) -> str:
    from moerl.analysis.geometry_claims import timing_line
    return timing_line(geometry)


def section_06_answer(geometry: Path) -> str:
    """The measured facts the 06 README's answer cites (moerl.analysis.geometry_claims.answer_lines)."""
    from moerl.analysis import geometry_claims
    from moerl.analysis.geometry_report import load_points

    exp05 = geometry_claims.experiment_05_share(geometry.parent / "runs" / "05_mismatch_consequences" / "baseline")
    return "\n".join(geometry_claims.answer_lines(load_points(geometry), exp05, geometry))


def section_06_fits(geometry: Path) -> str:
    """The ladders' fitted slopes and the extrapolation to each cluster model's real geometry and width."""
    from moerl.analysis import geometry_claims
    from moerl.analysis.geometry_report import load_points, predictions

    df = load_points(geometry)
    return "\n".join([*geometry_claims.fit_lines(df), "", *geometry_claims.prediction_lines(predictions(df))])


def section_06_gpu(geometry: Path) -> str:
    """The GPU width points beside the CPU's trained width ladder."""
    from moerl.analysis.geometry_claims import gpu_width_lines

    return "\n".join(gpu_width_lines(geometry))


# -- experiment 07 ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)  # several sections read the same runs; cleared at each main()
def _runs_07(runs_root: Path, grids: str) -> list[dict]:
    """Experiment 07's runs (moerl.analysis.dose.load_runs), read once per call of main()."""
    from moerl.analysis.dose import load_runs

    return load_runs(runs_root, grids=grids)


def section_07(runs_root: Path) -> str:
    """The seed-0 ladder in one sentence. The threshold under the 3-seed regime check and the dose order of the
    4-bit rungs stay in the experiment's README: the front page does not restate a check that the registered
    12-seed control supersedes (its verdict is in the list below)."""
    from moerl.analysis.dose import mismatch_order

    from moerl.analysis import dose_report as report
    runs = _runs_07(runs_root, "recorded")
    ladder, _ = report.ladder_rows(runs)
    # the ladder itself is the figure above this section (and a table in the experiment's README)
    collapsed = [f"{rung} (step {ladder[rung]['collapse_step']})" for rung in mismatch_order(ladder)
                 if ladder[rung]["collapse_step"] is not None]
    return (f"Seed-0 ladder: the uncorrected run collapses at {', '.join(collapsed) or 'no rung'}; the fp32 control "
            f"goes {_f(ladder['fp32']['pass1_start'], '.3f')} → {_f(ladder['fp32']['pass1_end'], '.3f')} held-out "
            "pass@1." if "fp32" in ladder else "Seed-0 ladder: no fp32 control recorded.")


def section_07_ladder(runs_root: Path) -> str:
    """The seed-0 ladder pilot's table, as the report prints it."""
    from moerl.analysis import dose_report as report
    return "\n".join(report.ladder_table(report.ladder_rows(_runs_07(runs_root, "recorded"))[0]))


@functools.lru_cache(maxsize=None)  # one section per rung reads it; cleared at each main()
def _main_grid_07(runs_root: Path) -> dict[str, dict]:
    """Experiment 07's main grid as the report computes it (moerl.analysis.dose), per rung."""
    from moerl.analysis import dose_report as report
    runs = _runs_07(runs_root, "recorded")
    report.registration(runs)  # the grid's start, which the post-hoc labels are judged against
    return report.grid(runs)


def section_07_main(runs_root: Path, rung: str) -> str:
    """One rung of the main grid as the report prints it: per arm the paired differences and the verdicts,
    with the regime gate and every post-hoc label."""
    from moerl.analysis import dose_report as report
    g = _main_grid_07(runs_root).get(rung)
    if g is None:
        return f"Main grid at {rung}: not run yet."
    return "\n".join([f"Baseline seeds {g['baseline_seeds']} ({g['baseline_collapsed']} collapsed), control seeds "
                      f"{g['control_seeds']}; regime: {g['regime']['status']}.", "", *report.grid_table(g)])


@functools.lru_cache(maxsize=None)  # two sections read the same runs; cleared at each main()
def _confirmatory(runs_root: Path) -> dict:
    from moerl.analysis import confirmatory

    from moerl.analysis import dose_report as report
    every_run = _runs_07(runs_root, "all")
    return {"report": report, "runs": every_run,
            "result": confirmatory.report(every_run, report.REGISTERED, confirmatory.rules_of(report.REGISTERED))}


def section_07_registered(runs_root: Path) -> str:
    """The registered (confirmatory and mechanism) grids: progress, and each complete grid's verdicts with
    the bounds its rule reads, its power and its registration status -- the RESULTS.md section, verbatim."""
    c = _confirmatory(runs_root)
    text = c["report"].confirmatory_markdown(c["runs"]).strip().splitlines()
    return "\n".join(line for line in text if not line.startswith("### "))


FRONT_PAGE = "README.md"
# bytes: the front page is read in one sitting; longer tables live in the experiments' READMEs (16 KiB since the
# five-line "what we found" joined the registered verdict list)
FRONT_PAGE_LIMIT = 16 * 1024
HEADLINE_VERDICTS = 8  # a grid with more verdicts than this names each comparison once on the front page


# Plain words for the registered comparisons on the front page (the rule names live in the experiment's README).
PLAIN_ARMS = {"baseline": "no correction", "r3": "R3", "tis": "TIS", "icepop": "IcePop", "r3_tis": "R3 + TIS",
              "mis": "MIS", "qat_int4": "QAT (trainer on the INT4 grid)", "qat_int4_r3": "QAT + R3",
              "qat_int4_tis": "QAT + TIS"}
PLAIN_RUNGS = {"nvfp4_experts": "NVFP4 experts", "nvfp4_attention": "NVFP4 attention", "int4_experts": "INT4 experts",
               "int4_attention": "INT4 attention", "int4_kimi": "Kimi's INT4 experts"}


def plain_comparison(name: str) -> str:
    """A registered comparison in words a newcomer can read: 'r3 helps' -> 'R3 beats no correction'."""
    arm = lambda a: PLAIN_ARMS.get(a, a)  # noqa: E731
    if name == "regime":
        return "the fp32 control learns"
    if name == "baseline behind control":
        return "no correction ends below the control"
    if m := re.fullmatch(r"(\w+) like_control", name):
        return f"{arm(m[1])} ends like the control"
    if m := re.fullmatch(r"(\w+) helps", name):
        return f"{arm(m[1])} beats no correction"
    if m := re.fullmatch(r"(\w+) helps over (\w+)(?: at \w+)?", name):
        return f"{arm(m[1])} beats {arm(m[2])}"
    if m := re.fullmatch(r"(\w+) keeps_drifting", name):
        return f"k3 still grows under {arm(m[1])}"
    if m := re.fullmatch(r"baseline collapses", name):
        return "no correction collapses"
    if m := re.fullmatch(r"(\w+) prevents collapse", name):
        return f"{arm(m[1])} prevents the collapse"
    return name.replace("_", " ")


def _headline_verdict(v: dict) -> str:
    """'**yes**', or '**yes** (Holm: inconclusive)' where the family-wise reading differs."""
    holm = v.get("verdict_holm")
    return f"**{v['verdict']}**" + (f" (Holm: {holm})" if holm and holm != v["verdict"] else "")


def section_07_headline(runs_root: Path) -> str:
    """The registered grids' verdicts in plain words, one line per complete grid, each verdict as read with its
    family-wise (Holm) reading beside it where that differs (bounds, p, power and registration: the
    experiment's README)."""
    c = _confirmatory(runs_root)
    titles = {"confirmatory_control": "control", "confirmatory_fp8": "fp8 rollouts",
              "confirmatory_nvfp4_600": "NVFP4, 600 steps", "mechanism": "4-bit halves",
              "crossover": "dose or location"}
    lines = []
    for grid, verdicts in c["result"]["verdicts"].items():
        n = max((v.get("gain", v).get("n") or (v.get("power") or {}).get("n") or 0) for v in verdicts.values())
        if len(verdicts) > HEADLINE_VERDICTS:  # a per-rung grid: each comparison once, its rungs by verdict
            by_comparison: dict[str, dict[str, list[str]]] = {}
            for name, v in verdicts.items():
                comparison, _, rung = name.rpartition(" at ") if " at " in name else (name, "", "")
                by_comparison.setdefault(comparison, {}).setdefault(_headline_verdict(v), []).append(rung)
            # "not tested" (nothing to prevent where no correction collapsed) is left to the experiment's README
            items = [f"{plain_comparison(comparison)}: " + ", ".join(
                verdict + (f" with {', '.join(PLAIN_RUNGS.get(r, r) for r in rungs)}" if any(rungs) else "")
                for verdict, rungs in by_verdict.items() if verdict != "**not tested**")
                for comparison, by_verdict in by_comparison.items()
                if any(verdict != "**not tested**" for verdict in by_verdict)]
        else:
            items = [f"{plain_comparison(name)} {_headline_verdict(v)}"
                     + (" (acts on too few tokens)" if "floor_ungated" in v else " (gated)" if "ungated" in v else "")
                     for name, v in verdicts.items()]
        lines.append(f"- {titles.get(grid, grid)} ({n} seeds): " + "; ".join(items))
    left = [f"`{g}` {p['finished']}/{p['planned']}" for g, p in c["result"]["progress"].items() if not p["complete"]]
    return "\n".join(["Registered verdicts (Holm: corrected within each grid):", "",
                      *lines] + ([f"- still running: {', '.join(left)}"] if left else []))


def _early_k3(run: dict, steps: int = 50) -> float | None:
    """A run's mean k3 over its first ``steps`` steps (the dose before any collapse)."""
    from moerl.tracking import read_metrics

    k3 = [r["mismatch/k3"] for r in read_metrics(Path(run["run_dir"]) / "metrics.jsonl")
          if isinstance(r.get("mismatch/k3"), float) and r["step"] <= steps]
    return sum(k3) / len(k3) if k3 else None


def section_found(runs_root: Path) -> str:
    """The front page's "what we found": five plain sentences from experiment 07's registered grids, each
    linking to the table its verdict is printed in; a grid not complete says so instead of a finding."""
    import statistics

    from moerl.analysis import confirmatory as conf

    c = _confirmatory(runs_root)
    runs, result, registered = c["runs"], c["result"], c["report"].REGISTERED
    verdicts, progress = result["verdicts"], result["progress"]
    results = "experiments/07_dose_threshold/README.md#results"
    cell = lambda grid, arm, rung: conf.cell_by_seed(runs, grid, arm, rung, registered)  # noqa: E731
    collapsed = lambda runs_: f"{sum(r.get('collapse_step') is not None for r in runs_.values())} of {len(runs_)}"  # noqa: E731
    gain = lambda runs_: statistics.mean(r["pass1_end"] - r["pass1_start"] for r in runs_.values())  # noqa: E731
    lines = []
    link = "([verdict][v07])"  # one reference-style target, defined after the list
    if "mechanism" in verdicts:
        m = {rung: cell("mechanism", "baseline", rung) for rung in registered["grids"]["mechanism"]["rungs"]}
        experts = {**m["nvfp4_experts"], **{100 + s: r for s, r in m["int4_experts"].items()}}
        regime = verdicts.get("confirmatory_control", {}).get("regime", {}).get("verdict", "not yet read")
        lines.append(f"1. **4-bit attention collapses uncorrected GRPO.** Attention in 4 bits: collapsed in "
                     f"{collapsed(m['int4_attention'])} seeds (INT4), {collapsed(m['nvfp4_attention'])} (NVFP4); routed "
                     f"experts in 4 bits: {collapsed(experts)}; the fp32 control learns: **{regime}** {link}.")
        dose = {half: statistics.median(k for r in [*m[f"int4_{half}"].values(), *m[f"nvfp4_{half}"].values()]
                                        if (k := _early_k3(r)) is not None) for half in ("attention", "experts")}
        cross = progress.get("crossover", {})
        lines.append(f"2. **Attention or dose: open.** Attention-only gave {dose['attention'] / dose['experts']:.1f}x the "
                     "experts-only mismatch (k3, first 50 steps); a dose-matched crossover separates the two"
                     + (f" (running, {cross['finished']} of {cross['planned']} runs)" if cross and not cross["complete"]
                        else "") + f" {link}.")
    if "confirmatory_fp8" in verdicts:
        v = verdicts["confirmatory_fp8"]
        lines.append(f"3. **fp8: R3 + TIS trains like the fp32 control** (**{v['r3_tis like_control']['verdict_holm']}** "
                     f"under Holm); R3 alone's {v['r3 helps']['mean']:+.3f} over no correction reads "
                     f"**{v['r3 helps']['verdict_holm']}** (Holm p {v['r3 helps']['p_holm']:.3f}) {link}.")
    if "confirmatory_nvfp4_600" in verdicts:
        v = verdicts["confirmatory_nvfp4_600"]
        growth = [g for x in v.values() for g in x["k3_growth"]]
        arms = [cell("confirmatory_nvfp4_600", a, "nvfp4") for a in ("tis", "icepop", "r3_tis")]
        holds = any(x["verdict_holm"] == "yes" for x in v.values())
        lines.append(f"4. **NVFP4, 600 steps: TIS, IcePop, R3 + TIS stop the collapse** "
                     f"({', '.join(collapsed(a) for a in arms)} collapsed); their k3's {min(growth):.1f}-{max(growth):.1f}x "
                     f"growth {'survives' if holds else 'is not shown beyond chance under'} Holm and awaits its "
                     f"mismatch-free null {link}.")
    if "mechanism" in verdicts:
        v = verdicts["mechanism"]
        kimi, qat = cell("mechanism", "baseline", "int4_kimi"), cell("mechanism", "qat_int4", "int4_kimi")
        lines.append(f"5. **Kimi's INT4 experts, without and with its QAT recipe.** Without it: {gain(kimi):+.2f} pass@1, "
                     f"{collapsed(kimi)} collapsed; with it: {gain(qat):+.2f}, like the control as read "
                     f"(**{v['qat_int4 like_control']['verdict_holm']}** under Holm) {link}.")
    return ("\n".join(lines) + f"\n\n[v07]: {results}") if lines else \
        "No registered grid of experiment 07 is complete yet."


def section_07_dose(out: Path) -> str:
    """The dose each rung gives at the warm start (dose_at_warm_start.json): the table and its spans."""
    import json

    from moerl.analysis.dose_report import warm_start_dose_lines, warm_start_dose_summary

    points = json.loads((out / "dose_at_warm_start.json").read_text())
    return "\n".join([*warm_start_dose_lines(points), "", warm_start_dose_summary(points)])


def section_07_calibration(results: Path) -> str:
    """calibrate.py's table (calibration.json), the chosen warm start in bold (base.yaml), experiment 05's
    saturated warm start beside it (its fp32 control's step-0 evaluation), and the choice against the criteria."""
    import json

    import yaml

    from moerl.analysis.dose_facts import calibration_lines, calibration_summary
    from moerl.tracking import read_metrics

    table = {int(k): v for k, v in json.loads((results / "07_dose_threshold" / "calibration.json").read_text()).items()}
    chosen = yaml.safe_load((REPO / "experiments/07_dose_threshold/base.yaml").read_text())["warm_start"]["steps"]
    run05 = results / "runs" / "05_mismatch_consequences" / "fp32_rollout" / "seed0"
    first = next(r for r in read_metrics(run05 / "metrics.jsonl") if "eval/pass1" in r)
    steps05 = yaml.safe_load((run05 / "config.yaml").read_text())["warm_start"]["steps"]
    saturated = (steps05, {"pass1": first["eval/pass1"], "greedy": first["eval/greedy"]})
    return "\n".join([*calibration_lines(table, chosen, saturated), "", calibration_summary(table, chosen)])


def section_07_pilots(pilots: Path) -> str:
    """The regime pilots' table (report.py --pilots results/pilots/07_r*), in the order they were run."""
    from moerl.analysis.pilots import regime_table

    dirs = sorted(pilots.glob("07_r*"), key=lambda d: int(re.match(r"07_r(\d+)", d.name).group(1)))
    return regime_table(dirs)


def section_07_control(results: Path) -> str:
    """The 3-seed control and its supplementary re-measurement (moerl.analysis.dose_facts.control_facts)."""
    import json

    from moerl.analysis.dose_facts import control_facts

    again = results / "07_dose_threshold" / "control_reevaluated.json"
    return control_facts(_runs_07(results / "runs", "recorded"),
                         json.loads(again.read_text()) if again.exists() else None)


def _weight_error_line() -> str:
    from moerl.analysis.dose_facts import weight_error_line
    return weight_error_line()


def section_07_ladder_facts(runs_root: Path) -> str:
    from moerl.analysis.dose_facts import ladder_facts
    return ladder_facts(_runs_07(runs_root, "recorded"))


def section_07_grid_facts(runs_root: Path, rung: str) -> str:
    from moerl.analysis.dose_facts import grid_facts
    return grid_facts(_runs_07(runs_root, "recorded"), rung)


def section_07_mechanism_facts(runs_root: Path) -> str:
    from moerl.analysis.dose_facts import mechanism_facts

    c = _confirmatory(runs_root)
    return mechanism_facts(c["runs"], c["report"].REGISTERED, _runs_07(runs_root, "recorded"))


def section_07_drift_facts(runs_root: Path) -> str:
    from moerl.analysis.dose_facts import drift_facts

    c = _confirmatory(runs_root)
    return drift_facts(c["runs"], c["report"].REGISTERED)


def section_command_times(results: Path) -> str:
    """The README's time table: each documented command's wall time, measured by scripts/time_commands.py."""
    import json

    sys.path.insert(0, str(REPO / "scripts"))
    from time_commands import table

    path = results / "command_times.json"
    if not path.exists():
        return "Not measured yet: `.venv/bin/python scripts/time_commands.py`."
    record = json.loads(path.read_text())
    dates = sorted({r["date"] for r in record["commands"].values()})
    return table(record) + f"\n\nBy `scripts/time_commands.py` ({', '.join(dates)}; other jobs on the machine)."


# name -> (the files that carry the section, relative to the repository; how to compute it from results/)
SECTIONS = {
    "command_times": (["README.md"], section_command_times),
    "metrics": (["docs/metrics.md"], lambda results: __import__("moerl.trainer.metric_docs", fromlist=["markdown"]).markdown()),
    "experiments": (["README.md"], lambda results: section_experiments(results)),
    "00": (["README.md", "experiments/00_tiny_moe_cpu/README.md"], lambda results: section_00(results / "runs")),
    "00_setup": (["experiments/00_tiny_moe_cpu/README.md"], section_00_setup),
    "kernels_fidelity": (["docs/rollout_kernels.md"], section_kernels_fidelity),
    "kernels_speed": (["docs/rollout_kernels.md"], section_kernels_speed),
    "kernels_peer": (["docs/rollout_kernels.md"], section_kernels_peer),
    "benchmarks": (["docs/benchmarks.md"], section_benchmarks),
    "05": (["README.md"], lambda results: section_05(results / "runs")),
    "05_claims": (["experiments/05_mismatch_consequences/README.md"], lambda results: section_05_claims(results / "runs")),
    "05_facts": (["experiments/05_mismatch_consequences/README.md"], lambda results: section_05_facts(results / "runs")),
    "05_pilots": (["experiments/05_mismatch_consequences/README.md"],
                  lambda results: section_05_pilots(results / "pilots")),
    "05_pilot_facts": (["experiments/05_mismatch_consequences/README.md"],
                       lambda results: section_05_pilot_facts(results / "pilots")),
    "06": (["README.md", "experiments/06_routing_geometry/README.md"], lambda results: section_06(results / "geometry")),
    "06_answer": (["experiments/06_routing_geometry/README.md"], lambda results: section_06_answer(results / "geometry")),
    "06_timing": (["experiments/06_routing_geometry/README.md"], lambda results: _geometry_timing(results / "geometry")),
    "06_fits": (["experiments/06_routing_geometry/README.md"], lambda results: section_06_fits(results / "geometry")),
    "06_gpu": (["experiments/06_routing_geometry/README.md"], lambda results: section_06_gpu(results / "geometry")),
    "07": (["README.md"], lambda results: section_07(results / "runs")),
    "07_headline": (["README.md"], lambda results: section_07_headline(results / "runs")),
    "found": (["README.md"], lambda results: section_found(results / "runs")),
    "07_ladder": (["experiments/07_dose_threshold/README.md"], lambda results: section_07_ladder(results / "runs")),
    "07_main_nvfp4": (["experiments/07_dose_threshold/README.md"],
                      lambda results: section_07_main(results / "runs", "nvfp4")),
    "07_main_fp8": (["experiments/07_dose_threshold/README.md"],
                    lambda results: section_07_main(results / "runs", "fp8")),
    "07_dose": (["experiments/07_dose_threshold/README.md"],
                lambda results: section_07_dose(results / "07_dose_threshold")),
    "07_registered": (["experiments/07_dose_threshold/README.md"],
                      lambda results: section_07_registered(results / "runs")),
    "07_calibration": (["experiments/07_dose_threshold/README.md"], section_07_calibration),
    "07_pilots": (["experiments/07_dose_threshold/README.md"], lambda results: section_07_pilots(results / "pilots")),
    "07_weight_error": (["experiments/07_dose_threshold/README.md"], lambda results: _weight_error_line()),
    "07_control": (["experiments/07_dose_threshold/README.md"], section_07_control),
    "07_ladder_facts": (["experiments/07_dose_threshold/README.md"],
                        lambda results: section_07_ladder_facts(results / "runs")),
    "07_facts_nvfp4": (["experiments/07_dose_threshold/README.md"],
                       lambda results: section_07_grid_facts(results / "runs", "nvfp4")),
    "07_facts_mechanism": (["experiments/07_dose_threshold/README.md"],
                           lambda results: section_07_mechanism_facts(results / "runs")),
    "07_facts_drift": (["experiments/07_dose_threshold/README.md"],
                       lambda results: section_07_drift_facts(results / "runs")),
    "07_facts_fp8": (["experiments/07_dose_threshold/README.md"],
                     lambda results: section_07_grid_facts(results / "runs", "fp8")),
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- generated:{name} begin ({WRITER}) -->", f"<!-- generated:{name} end -->"


def fill(text: str, name: str, body: str, path: Path) -> str:
    begin, end = markers(name)
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no generated section '{name}' (expected the line {begin} ... {end})")
    return pattern.sub(lambda _: f"{begin}\n{body.rstrip()}\n{end}", text, count=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(REPO / "results"), help="the recorded results (runs/, geometry/)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if any section differs")
    ap.add_argument("--only", default="", help=f"comma-separated sections (of {', '.join(SECTIONS)}; default all)")
    ap.add_argument("--root", default=str(REPO), help="where the READMEs are (default: this repository)")
    args = ap.parse_args(argv)
    _confirmatory.cache_clear()  # results may have changed since a previous call in this process
    _runs_07.cache_clear()
    _runs_05.cache_clear()
    _main_grid_07.cache_clear()
    wanted = [n for n in args.only.split(",") if n] or list(SECTIONS)
    unknown = [n for n in wanted if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"--only {args.only}: unknown section(s) {unknown} (have: {', '.join(SECTIONS)})")
    root = Path(args.root)
    texts: dict[Path, str] = {}
    stale = []
    started = time.perf_counter()
    for i, name in enumerate(wanted, 1):
        files, compute = SECTIONS[name]
        # progress on stderr: the sections read every recorded run and take about a minute together
        print(f"[write_readme_numbers] {i}/{len(wanted)} {name} ({time.perf_counter() - started:.0f} s)",
              file=sys.stderr, flush=True)
        body = compute(Path(args.results))
        for path in (root / f for f in files):
            old = texts.get(path, path.read_text())
            new = fill(old, name, body, path)
            if new != old:
                stale.append(f"{path.relative_to(root)}: section '{name}'")
            texts[path] = new
    front = root / FRONT_PAGE
    if front in texts and len(texts[front].encode()) > FRONT_PAGE_LIMIT:
        print(f"{FRONT_PAGE}: would be {len(texts[front].encode())} bytes with the generated sections, over its "
              f"{FRONT_PAGE_LIMIT}-byte limit; shorten its prose or tally a section (nothing written)")
        return 1
    if args.check:
        if stale:
            print("stale generated sections (run python scripts/write_readme_numbers.py):\n  " + "\n  ".join(stale))
            return 1
        print("every generated section matches the results")
        return 0
    from moerl.tracking import atomic_write_text

    for path, text in texts.items():
        if text != path.read_text():
            atomic_write_text(path, text)
            print(f"wrote {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
