"""The closing answer of each analysis notebook, computed from the runs it draws.

A notebook ends by stating what its data show, not what one would expect: each function here takes
the frames the notebook loaded and returns a short markdown paragraph whose every number is computed
from them. They work on any experiment's runs (an arm or metric a run did not record is left out, and
the paragraph says when there is nothing to compare).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

HEAD = "**Answer, computed from these runs.** "


def _pct(x: float) -> str:
    return "n/a" if x is None or x != x else (f"{100 * x:.2g} %" if abs(x) < 0.01 else f"{100 * x:.1f} %")


def paired_run_ratios(train: pd.DataFrame, key: str, references: dict[str, str], stat: str = "median") -> pd.DataFrame:
    """Per arm: ``stat`` over its steps of ``key``, divided by its reference arm's on the same seed
    (seeds share prompts and initial weights); median, min and max over seeds and their number."""
    if key not in train:
        return pd.DataFrame(columns=["median", "lo", "hi", "n"])
    per_run = getattr(train.groupby(["arm", "seed"])[key], stat)().unstack("seed")
    rows = {}
    for arm, ref in references.items():
        if arm == ref or arm not in per_run.index or ref not in per_run.index:
            continue
        ratio = (per_run.loc[arm] / per_run.loc[ref]).replace([np.inf, -np.inf], np.nan).dropna()
        if len(ratio):
            rows[arm] = {"median": ratio.median(), "lo": ratio.min(), "hi": ratio.max(), "n": len(ratio)}
    return pd.DataFrame.from_dict(rows, orient="index", columns=["median", "lo", "hi", "n"])


def _side(r: pd.Series, floor: float = 1e-3) -> str:
    if r["median"] < floor:
        return "floor"
    if r["hi"] < 1:
        return "below"
    if r["lo"] > 1:
        return "above"
    return "straddles"


def _ratio_text(arm: str, r: pd.Series, ref: str) -> str:
    seeds = f", seeds {r['lo']:.2g}–{r['hi']:.2g}" if r["n"] > 1 else ", 1 seed"
    return f"{arm} {r['median']:.2g}× {ref}{seeds}"


def mismatch(train: pd.DataFrame, references: dict[str, str]) -> str:
    """Notebook 01: which arms change k3 against their own family's baseline (run-median k3, paired
    by seed); an arm whose every seed lies on one side of 1 is said to shrink or grow it."""
    ratios = paired_run_ratios(train, "mismatch/k3", references)
    if ratios.empty:
        return HEAD + "no arm has a family baseline with k3 on the same seed here: nothing to compare."
    sides = {arm: _side(r) for arm, r in ratios.iterrows()}
    text = lambda side: "; ".join(_ratio_text(a, ratios.loc[a], references[a]) for a in ratios.index  # noqa: E731
                                  if sides[a] == side) or "none"
    # each run's median step, then the mean over seeds: the README's and RESULTS.md's "k3, run median"
    bases = (train[train["arm"].isin(set(references.values()))].groupby(["arm", "seed"])["mismatch/k3"].median()
             .groupby("arm").mean())
    out = [HEAD + "run-median k3 of the baselines (mean of seeds): "
           + ", ".join(f"{a} {v:.2e}" for a, v in bases.items()) + ".",
           f"Lower than its family baseline on every seed: {text('below')}.",
           f"Higher on every seed: {text('above')}.",
           f"Within the seeds' spread (not told apart from the baseline): {text('straddles')}."]
    floor = [a for a, s in sides.items() if s == "floor"]
    if floor:
        out.append(f"At the numerical floor (no rollout mismatch): {', '.join(floor)}.")
    return " ".join(out)


CORRECTIONS = (("clip/frac", "PPO-clipped"), ("is/truncated_frac", "TIS-truncated"),
               ("mask/token_frac", "masked (MIS/IcePop)"), ("effective/token_frac", "keeping a gradient"))


def touched(train: pd.DataFrame) -> str:
    """Notebook 02: the share of response tokens each mechanism touches, mean over steps and seeds,
    per arm: the arm it touches most, and the arms that keep the fewest tokens."""
    frame = train.copy()
    if "clip/frac" not in frame and {"clip/low_frac", "clip/high_frac"} <= set(frame):
        frame["clip/frac"] = frame["clip/low_frac"] + frame["clip/high_frac"]
    parts = []
    for key, name in CORRECTIONS:
        if key not in frame or not frame[key].notna().any():
            continue
        share = frame.groupby(["arm", "seed"])[key].mean().groupby("arm").mean().dropna()
        if key == "effective/token_frac":
            low = share.sort_values().head(3)
            parts.append("fewest tokens " + name + ": " + ", ".join(f"{a} {_pct(v)}" for a, v in low.items()))
        else:
            acted = share[share > 0].sort_values(ascending=False)
            parts.append(f"{name}: " + (", ".join(f"{a} {_pct(v)}" for a, v in acted.head(3).items())
                                        + (f" (then {len(acted) - 3} more arms)" if len(acted) > 3 else "")
                                        if len(acted) else "0 in every arm"))
    if not parts:
        return HEAD + "none of the clip, truncation, masking or effective-token metrics was recorded."
    return HEAD + "share of response tokens, mean over steps and seeds (largest first): " + "; ".join(parts) + "."


def importance(tokens: pd.DataFrame, references: dict[str, str], key: str = "token_ratio") -> str:
    """Notebook 03: the per-token ratio's p1-p99 spread per arm, whether it widens from the first to
    the last sampled step, and whether an arm's tokens sit nearer the diagonal than its baseline's
    (p99 of |log pi_old - log pi_rollout| relative to the family baseline's)."""
    parts = []
    for arm, sub in tokens.groupby("arm"):
        x = sub[key].to_numpy(dtype=float)
        steps = sorted(sub["step"].unique())
        first = np.quantile(sub.loc[sub["step"] == steps[0], key], [0.01, 0.99])
        last = np.quantile(sub.loc[sub["step"] == steps[-1], key], [0.01, 0.99])
        widen = np.log(last[1] / last[0]) / max(np.log(first[1] / first[0]), 1e-300)
        parts.append(f"{arm} [{np.quantile(x, 0.01):.3g}, {np.quantile(x, 0.99):.3g}]"
                     f" (step {steps[0]} → {steps[-1]}: spread ×{widen:.2g})")
    delta = (tokens["trainer_logp"] - tokens["rollout_logp"]).abs().groupby(tokens["arm"]).quantile(0.99)
    closer = [f"{arm} {delta[arm] / delta[ref]:.2g}× {ref}" for arm, ref in sorted(references.items())
              if arm != ref and arm in delta and ref in delta and delta[ref] > 0]
    out = HEAD + "per-token π_old/π_rollout, p1–p99 over all sampled steps and seeds: " + "; ".join(parts) + "."
    if closer:
        out += (" Distance from the diagonal (p99 of |log π_old − log π_rollout|) against the family baseline: "
                + "; ".join(closer) + " (below 1: nearer the diagonal).")
    return out


def routing(train: pd.DataFrame, presets: dict[str, str] | None = None) -> str:
    """Notebook 04: per arm, native-vs-rollout disagreement in the first and last MoE layer and the
    rank correlation of disagreement with depth; the replayed arms' replayed agreement and violations."""
    cols = sorted((c for c in train.columns if c.startswith("routing/agreement/layer")),
                  key=lambda c: int(c.rsplit("layer", 1)[1]))
    if not cols:
        return HEAD + "no per-layer routing agreement was recorded."
    parts, rising = [], 0
    for arm, sub in train.groupby("arm"):
        dis = (1 - sub[cols].mean()).dropna()
        if len(dis) < 2 or not (dis > 0).any():  # an fp32 rollout: nothing differs in any layer
            continue
        layers = [int(c.rsplit("layer", 1)[1]) for c in dis.index]
        rho = pd.Series(dis.values).rank().corr(pd.Series(layers, dtype=float).rank())  # Spearman
        rising += rho > 0.5
        parts.append(f"{arm} {_pct(dis.iloc[0])} (layer {layers[0]}) → {_pct(dis.iloc[-1])} (layer {layers[-1]}), "
                     f"rank correlation with depth {rho:+.2f}")
    out = (HEAD + f"native top-k differing from the rollout's rises with depth (rank correlation > 0.5) in {rising} "
           f"of {len(parts)} arms: " + "; ".join(parts) + ".")
    if "routing/replayed_agreement" in train and train["routing/replayed_agreement"].notna().any():
        rep = train.groupby("arm")["routing/replayed_agreement"].mean().dropna()
        viol = train.groupby("arm")["replay/violations"].sum() if "replay/violations" in train else pd.Series(dtype=float)
        out += (" Replayed rows that took the trace's experts: "
                + ", ".join(f"{a} {100 * v:.2f} %" + (f" ({int(viol[a])} violations)" if a in viol else "")
                            for a, v in rep.items()) + ".")
    return out


def refit(benches: dict[str, dict]) -> str:
    """Notebook 05: adapter-only against merged refit, per preset of each benchmark file, and the
    engine copy's relative error after the last refit of the drift run."""
    parts = []
    for name, bench in benches.items():
        for p in bench.get("presets", []):
            a, m = p.get("adapter", {}), p.get("merged", {})
            if a.get("seconds_median") and m.get("seconds_median") and a.get("bytes") and m.get("bytes"):
                parts.append(f"{name}/{p.get('preset')}: adapter-only refit {m['seconds_median'] / a['seconds_median']:.2g}× "
                             f"faster and {m['bytes'] / a['bytes']:.2g}× fewer bytes than merged "
                             f"({1e3 * a['seconds_median']:.3g} vs {1e3 * m['seconds_median']:.3g} ms)")
        for mode, values in (bench.get("drift") or {}).items():
            if values:
                parts.append(f"{name}: {mode} engine weights' relative error {values[0]:.2g} after 1 refit, "
                             f"{values[-1]:.2g} after {len(values)}")
    return HEAD + ("; ".join(parts) + "." if parts else "no benchmark file holds adapter and merged timings.")


def consequences(claim_list, collapses: dict[tuple[str, int], int | None]) -> str:
    """Notebook 06: each claim's verdict in one line, and which runs collapsed."""
    verdicts = "; ".join(f"{c.claim}: **{c.verdict}**" for c in claim_list)
    runs: dict[str, list] = {}
    for (arm, _), step in sorted(collapses.items()):
        runs.setdefault(arm, []).append(step)
    fell = [f"{a} {sum(s is not None for s in v)}/{len(v)}" for a, v in runs.items() if any(s is not None for s in v)]
    return (HEAD + verdicts + ". Runs that collapsed (seeds collapsed/run): " + (", ".join(fell) or "none")
            + f", of {len(runs)} arms.")


def geometry(preds: pd.DataFrame, paper: float, gpu: pd.DataFrame | None = None) -> str:
    """Notebook 07: the measured share of tokens re-routed in >= 1 MoE layer at each cluster geometry,
    against the paper's figure, and the extrapolations to the real width that bracket it; with ``gpu``
    (scripts/gpu_width_geometry.py's points), what trained routers measured at the widest GPU point (its
    longest SFT there)."""
    parts = []
    for _, r in preds.iterrows():
        text = f"{r['model']}: measured {_pct(r.get('measured_share', np.nan))}"
        real = {c.removesuffix("_real_share"): r[c] for c in preds.columns if c.endswith("_real_share") and r[c] == r[c]}
        if real:
            text += ", at the real width " + "–".join(_pct(v) for v in (min(real.values()), max(real.values())))
        parts.append(text)
    measured = preds["measured_share"].dropna() if "measured_share" in preds else pd.Series(dtype=float)
    verdict = ""
    if len(measured):
        above = int((measured >= paper).sum())
        verdict = (f" Measured at hidden 64 with random routers, the share reaches the paper's {_pct(paper)} at "
                   f"{above} of {len(measured)} cluster geometries: the routing geometry (MoE layers × experts, "
                   "top-k) " + ("can" if above else "does not") + " by itself give a share that large at CPU width.")
    if gpu is not None and len(gpu):
        from moerl.analysis.geometry_report import gpu_reference_point

        w = gpu_reference_point(gpu)
        same = preds[(preds.L == w.L) & (preds.E == w.E) & (preds.k == w.k) & (preds.H == w.H)]
        where = f"{same.iloc[0]['model']}'s real width" if len(same) else f"{int(w.L)} x {int(w.E)}, top-{int(w.k)}"
        sft = f" ({w.sft_steps:.0f}-step SFT)" if w.get("sft_steps") == w.get("sft_steps") and w.get("sft_steps") else ""
        verdict += (f" Measured on {w.device} with trained routers{sft} at {where} (hidden {int(w.H)}): "
                    f"{_pct(w.share)} [{_pct(w.share_lo)}, {_pct(w.share_hi)}], "
                    + ("at or above" if w.share >= paper else "below") + f" the paper's {_pct(paper)}.")
    return HEAD + "share of tokens with ≥ 1 re-routed MoE layer — " + "; ".join(parts) + "." + verdict


def dose_ladder(runs: list[dict], registered: dict | None = None) -> str:
    """Notebook 08: the threshold rung (moerl.analysis.dose.threshold on the seed-0 ladder), at each
    main-grid rung each arm's final held-out pass@1 minus the control's on the same seed, and the verdicts
    of the registered grids that are complete (``registered``: moerl.analysis.confirmatory.report's
    ``verdicts``), which judge the same arms again on more seeds."""
    from moerl.analysis.dose import threshold

    control = next((r for r in runs if r["arm"] == "fp32_control" and r["seed"] == 0), None)
    ladder = {r["rung"]: r for r in runs if r["arm"] == "baseline" and r["seed"] == 0}
    if control is None or not ladder:
        return HEAD + "the seed-0 fp32 control or the uncorrected ladder has not run: no threshold to state."
    rung = threshold(ladder, control)
    collapsed = [f"{g} (step {r['collapse_step']})" for g, r in ladder.items() if r["collapse_step"] is not None]
    out = [HEAD + (f"the uncorrected arm first collapses at rollout {rung}, while the control learns"
                   if rung else "no threshold: the control does not learn by the rule, or no uncorrected rung collapses")
           + f"; collapsed rungs: {', '.join(collapsed) or 'none'}."]
    controls = {r["seed"]: r["pass1_end"] for r in runs if r["arm"] == "fp32_control" and r["pass1_end"] is not None}
    for g in sorted({r["rung"] for r in runs if r["arm"] not in ("baseline", "fp32_control")}):
        diffs = {}
        for r in runs:
            if r["rung"] == g and r["arm"] != "fp32_control" and r["seed"] in controls and r["pass1_end"] is not None:
                diffs.setdefault(r["arm"], []).append(r["pass1_end"] - controls[r["seed"]])
        out.append(f"At rollout {g}, final held-out pass@1 minus the control's (mean over seeds): "
                   + ", ".join(f"{a} {np.mean(d):+.3f} (n={len(d)})" for a, d in sorted(diffs.items())) + ".")
    for grid, verdicts in (registered or {}).items():
        out.append(f"Registered grid {grid}: " + "; ".join(f"{name} {v['verdict']}" for name, v in verdicts.items()) + ".")
    return " ".join(out)
