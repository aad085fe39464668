"""The benchmarks' latest recorded figures, read from the JSON files the benchmark scripts write.

docs/benchmarks.md opens with this table (``scripts/write_readme_numbers.py``) so the figure a reader
quotes is the one on disk, with its target and whether both sides of the comparison computed the same
numbers; the dated log below it tells how each figure came about and is kept by hand.

Each ``row_*`` reads one recording and returns a :class:`Row`, or a row that says the file is missing
(a benchmark not yet recorded on a fresh checkout is not an error). The targets are the ones the
scripts record beside their figures, except where a script has since set a different target for the
same task (bench_peer's per-experiment target): then both are named.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PEER_PYTHON = ".venv-peer/bin/python"  # the TRL venv, scripts/setup_peer_env.sh


@dataclass
class Row:
    benchmark: str
    command: str
    figure: str
    target: str
    same_numbers: str
    recorded: str
    python: str = ".venv/bin/python"

    def cells(self) -> list[str]:
        return [self.benchmark, f"`{self.python} {self.command}`", self.figure, self.target, self.same_numbers,
                self.recorded]


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _recorded(record: dict, threads: int | None = None) -> str:
    """'2026-11-27 11:50, 1 thread, Intel(R) Xeon(R) Processor' from what the recording kept."""
    machine = record.get("machine") or next((r.get("machine") for r in record.get("results", []) if r.get("machine")),
                                            None) or {}
    threads = threads if threads is not None else record.get("threads")
    parts = [record.get("when") or "date not recorded"]
    if threads is not None:
        parts.append(f"{threads} thread{'s' if threads != 1 else ''}")
    if machine.get("cpu_model"):
        parts.append(machine["cpu_model"])
    load = record.get("load_average_1min")
    if load:
        parts.append(f"load {load[0]:.1f} → {load[-1]:.1f}")
    return ", ".join(parts)


def _missing(benchmark: str, command: str, path: Path, results: Path, python: str = Row.python) -> Row:
    return Row(benchmark, command, f"not recorded (`results/{path.relative_to(results)}` absent)", "—", "—", "—",
               python=python)


def row_step(results: Path) -> Row:
    """bench_step.py: the GRPO step of experiment 00's default arm, the current code against the
    re-created old path, alternated in one process, at two threads and at one."""
    name, command = "one GRPO step, 00's default arm: now vs before", "benchmarks/bench_step.py [--threads 1]"
    records = [(p, _read(results / "step" / p)) for p in ("bench_step.json", "bench_step_threads1.json")]
    if not all(r for _, r in records):
        return _missing(name, command, results / "step" / "bench_step.json", results)
    figure = "; ".join(f"{r['threads']} thread{'s' if r['threads'] != 1 else ''}: **{r['speedup']:.2f}×** faster "
                       f"({r['medians']['before']['time/wall']:.2f} → {r['medians']['after']['time/wall']:.2f} s a step, wall)"
                       for _, r in records)
    target = f"≥ {records[0][1]['target']:g}×: " + _met(all(r["target_met"] for _, r in records))
    same = "yes, every step" if all(r["metrics_identical"] for _, r in records) else "**no**"
    return Row(name, command, figure, target, same, _recorded(records[0][1]))


def _peer_target_now(arm: str) -> float | None:
    """bench_peer.py's current target for the arm's experiment (it may postdate a recording), read from
    the script's ``TARGET`` / ``TARGETS`` constants without importing it (it imports TRL)."""
    tree = ast.parse((REPO / "benchmarks" / "bench_peer.py").read_text())
    constants = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                 and node.targets[0].id in ("TARGET", "TARGETS")}
    experiment = Path(arm).parts[1] if arm.startswith("experiments/") else None
    return constants.get("TARGETS", {}).get(experiment, constants.get("TARGET"))


def row_peer(results: Path, folder: str, task: str, arm: str | None = None) -> Row:
    """bench_peer.py: moerl's GRPO step over TRL's GRPOTrainer with the same model, LoRA, batch and
    reward, matched structure (old-logprob pass + 2 updates), alternated rounds in one process."""
    name = f"moerl / TRL `GRPOTrainer`, {task}"
    command = ("benchmarks/bench_peer.py --threads 1 --structures matched --rounds 6"
               + (f" --arm {arm}" if arm else "") + f" --out results/peer/{folder}")
    record = _read(results / "peer" / folder / "bench_peer.json")
    if record is None:
        return _missing(name, command, results / "peer" / folder / "bench_peer.json", results, PEER_PYTHON)
    matched = record["structures"]["matched"]
    figure = (f"**{matched['ratio']:.2f}** (paired per round {matched['paired_ratio']:.2f}); moerl's step "
              f"{record['moerl_phase_medians']['time/step']:.2f} s, rollout {record['moerl_phase_medians']['time/rollout']:.2f} s")
    now = _peer_target_now(record["arm"])
    target = f"≤ {record['target']:g}: {_met(matched['ratio'] <= record['target'])}"
    if now is not None and now != record["target"]:
        target = f"≤ {now:g}: {_met(matched['ratio'] <= now)} (the file records the earlier {record['target']:g})"
    checks = record.get("checks", {})
    same = ("same model, LoRA and base weights" if all(checks.get(k, {}).get("trl_matched") for k in
                                                         ("same_initial_lora", "same_base_weights")) and
            not checks.get("problems") else "**checks failed**: " + "; ".join(checks.get("problems", [])))
    return Row(name, command, figure, target, same, _recorded(record), python=PEER_PYTHON)


def row_floor(results: Path) -> Row:
    """bench_floor.py: a 07 step against its matrix-FLOP floor at this machine's GEMM rate."""
    name, command = "07's GRPO step against its FLOP floor", "benchmarks/bench_floor.py --isa default,AVX2"
    record = _read(results / "bench" / "floor" / "bench_floor.json")
    if record is None:
        return _missing(name, command, results / "bench" / "floor" / "bench_floor.json", results)
    parts, oks = [], []
    for res in record["results"]:
        regime = res["regimes"].get("07")
        if regime is None:
            continue
        label = "this CPU" if res["isa"] == "default" else f"{res['isa']} cap"
        parts.append(f"{label}: step **{regime['ratio']['time/step']:.1f}×**, rollout {regime['ratio']['time/rollout']:.1f}× "
                     f"({regime['gflop']['time/step']:.1f} GFLOP a step; a 300-step run {regime['run_minutes_estimate']:.1f} min; "
                     f"peak memory {regime['peak_rss_mib_so_far'] / 1024:.2f} GiB)")
        oks += [regime["ratio"][k] <= v for k, v in record["targets"]["07"].items()]
    targets = ", ".join(f"{k.split('/')[1]} ≤ {v:g}×" for k, v in record["targets"]["07"].items())
    first = record["results"][0]
    return Row(name, command, "; ".join(parts), f"{targets}: {_met(all(oks))}", "— (one path)",
               _recorded(record, first.get("threads")))


def row_rollout_paths(results: Path) -> Row:
    """bench_rollout_paths.py: the embedded engine's decode paths on 07's baseline arm, alternated."""
    name, command = "rollout decode paths, 07's baseline arm", "benchmarks/bench_rollout_paths.py"
    record = _read(results / "bench" / "rollout_paths" / "bench_rollout_paths.json")
    if record is None:
        return _missing(name, command, results / "bench" / "rollout_paths" / "bench_rollout_paths.json", results)
    ratios = record["ratio_to_generate"]
    figure = "; ".join(f"{path} **{ratio:.2f}×**" for path, ratio in ratios.items() if path != "generate") + \
        " `generate`'s time"
    same = "; ".join(f"{path}: " + ("bit-identical tokens, logprobs, routes" if all(same.values()) else
                                    "differs in " + ", ".join(k for k, v in same.items() if not v))
                     for path, same in record["identical_to_generate"].items())
    return Row(name, command, figure, "— (the loop is kept only while bit-identical)", same, _recorded(record))


def row_experts(results: Path) -> Row:
    """bench_experts.py: one 07 micro-batch's forward + backward through the grouped experts."""
    name, command = "trainer's grouped experts, one 07 micro-batch", "benchmarks/bench_experts.py [--compile]"
    record = _read(results / "bench" / "experts" / "bench_experts.json")
    if record is None:
        return _missing(name, command, results / "bench" / "experts" / "bench_experts.json", results)
    figure = f"moerl's local forward **{record['ratio']:.2f}×** transformers' `grouped_mm` time"
    compiled = _read(results / "bench" / "experts" / "bench_experts_compile.json")
    if compiled is not None:
        m = compiled["median_s"]
        figure += (f"; under `torch.compile` the policy takes **{m['moerl local + torch.compile'] / m['moerl local grouped_mm']:.1f}×** "
                   f"its eager time ({compiled['compiled']['graphs']} graphs, {compiled['compiled']['graph_breaks']} breaks)")
    same = ("logprobs and LoRA gradients bit-identical" if all(record["identical"].values()) else "**differs**")
    if compiled is not None:
        same += f"; compiled: logprobs within {compiled['compiled']['max_abs_logprob_difference']:.0e}"
    return Row(name, command, figure, "—", same, _recorded(record))


def row_refit(results: Path) -> Row:
    """bench_refit.py: the LoRA-only refit against the merged one, and each against a copy model."""
    name, command = "refit: adapter-only vs merged weights", "benchmarks/bench_refit.py"
    record = _read(results / "refit" / "bench_refit.json")
    if record is None:
        return _missing(name, command, results / "refit" / "bench_refit.json", results)
    big = max(record["presets"], key=lambda p: p["base_params"])
    t = record["targets"]
    figure = (f"{big['preset']} preset: adapter-only **{big['speedup_adapter_vs_merged']:.0f}×** faster than merged "
              f"({big['bytes_ratio']:.1f}× fewer bytes); measured / copy model: adapter {t['adapter']['ratio']:.1f}× "
              f"[{t['adapter']['ratio_range'][0]:.1f}–{t['adapter']['ratio_range'][1]:.1f}], merged {t['merged']['ratio']:.1f}× "
              f"[{t['merged']['ratio_range'][0]:.1f}–{t['merged']['ratio_range'][1]:.1f}]")
    target = (f"adapter ≤ {t['adapter']['limit']:g}×: {_met(t['adapter']['met'])}; "
              f"merged ≤ {t['merged']['limit']:g}×: {_met(t['merged']['met'])}")
    same = ("the engine is handed exactly the trainer's tensors (both modes)" if all(p["passes"][m]["identical"] for p in record["presets"]
                                                      for m in ("adapter", "merged")) else "**a pass differed**")
    return Row(name, command, figure, target, same, _recorded(record))


def row_replay(results: Path) -> Row:
    """bench_replay.py --instructions: routing capture + replay in callgrind instructions of a step."""
    name, command = "router replay's cost (capture + replay)", "benchmarks/bench_replay.py --instructions"
    record = _read(results / "replay" / "overhead.json")
    if record is None or "instructions" not in record:
        return _missing(name, command, results / "replay" / "overhead.json", results)
    ins = record["instructions"]
    figure = (f"**{ins['total_pct']:.2f} % ± {ins['resolution_pct']:.2f} %** of a step's instructions "
              f"(capture {ins['capture_pct']:.2f} %, replay {ins['replay_pct']:.2f} %); "
              f"{ins['vs_step_without_matmul']['total_pct']:.2f} % of the step without its matrix kernels")
    same = "same rollout tokens in every arm" if ins.get("same_rollout_tokens") else "**rollouts differed**"
    return Row(name, command, figure, f"≤ {ins['target_pct']:g} %: {_met(ins['target_met'])}", same,
               _recorded(ins) + ", instruction counts (not wall time)")


def row_geometry(results: Path) -> Row:
    """bench_geometry.py: one experiment-06 measurement pass at Kimi-K2's routing geometry."""
    name, command = "one 06 measurement pass at Kimi-K2's geometry", "benchmarks/bench_geometry.py"
    path = results / "bench" / "geometry" / "bench_geometry_kimi_k2_h64.json"
    record = _read(path)
    if record is None:
        return _missing(name, command, path, results)
    s = record["seconds"]
    figure = (f"**{record['pass_seconds']:.1f} s** a pass ({record['moe_layers']} MoE layers × {record['experts']} "
              f"experts, top-{record['top_k']}); rollout with routing capture {s['rollout']:.1f} s "
              f"({s['rollout'] / record['pass_seconds']:.0%})")
    return Row(name, command, figure, f"≤ {record['budget_seconds']:g} s: {_met(record['within_budget'])}",
               "— (one path)", _recorded(record, record["machine"].get("torch_threads")))


ROWS = (row_step, lambda r: row_peer(r, "threads1", "00's task"),
        lambda r: row_peer(r, "07", "07's task", "experiments/07_dose_threshold/arms/baseline.yaml"),
        row_floor, row_rollout_paths, row_experts, row_refit, row_replay, row_geometry)


def latest_table(results: Path) -> str:
    """The markdown table of every benchmark's latest recorded figure."""
    lines = ["| benchmark | command | latest recorded figure (sides measured in one run) | "
             "target | same numbers on both sides? | recorded |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row(results).cells()) + " |" for row in ROWS]
    return "\n".join(lines)
