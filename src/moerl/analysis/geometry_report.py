"""Experiment 06's tables, fits, figures and RESULTS section, from the point JSONs in results/geometry.

The extrapolation is a multiplicative one-factor-at-a-time model of the mean per-layer flip probability,
moving from a measured anchor point (L0, E0, k0, H0):

    log p = log p_anchor + b_L log(L / L0) + b_E log(E / E0) + b_k log(k / k0) + b_H log(H / H0)

each slope b fitted (least squares in log-log) on its own ladder of random-init Qwen3-MoE models around
the base (Qwen3-30B-A3B routing at hidden 64), and the >= 1-layer share predicted from p by
independence, 1 - (1 - p)^L. Three anchors: the base itself (random init); experiment 05's geometry with
trained routers; the base geometry after a short SFT. The two trained anchors move in depth along the
depth ladder of SFT'd routers (8 / 16 / 48 MoE layers) and along the random-init slopes otherwise. The interval adds,
in log p, each used slope's standard error times the distance moved and the ladder's residual scatter,
and the anchor's bootstrap interval. It is a stated model, not a law: the width slope comes from
hidden 64-256 and is applied at 2048-7168.

Two intervals are given. The first (``*_lo`` / ``*_hi``) treats every slope's error as normal (z = 1.96);
each slope is fitted on 3-5 points, so it has 1-3 degrees of freedom and that interval is too narrow. The
second (``*_lo_t`` / ``*_hi_t``, the one the verdicts use) draws each slope and each ladder's residual
scatter from a t distribution with its fit's n − 2 degrees of freedom (Monte Carlo, seeded), and gives
the probability that the predicted share reaches the paper's 94 % (``share_p94``).
"""
from __future__ import annotations

import itertools
import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from moerl.models.geometry import GEOMETRIES, public_config, routing_structure
from moerl.analysis.claims import PAPER_REROUTED as PAPER_SHARE  # the R3 paper's ~94 %, one constant for 05 and 06
from moerl.analysis.routing_geometry import fit_loglinear

BASE = {"L": 48, "E": 128, "k": 8, "H": 64}
FACTORS = {"depth": "L", "experts": "E", "topk": "k", "width": "H"}
LABELS = {"qwen3_30b_a3b": "Qwen3-30B-A3B", "moonlight_16b_a3b": "Moonlight-16B-A3B", "deepseek_v3": "DeepSeek-V3",
          "kimi_k2": "Kimi-K2"}


def load_points(root: str | Path = "results/geometry", pattern: str = "*.json") -> pd.DataFrame:
    """One row per (point, rollout dtype) with its factors and statistics; FileNotFoundError naming
    the directory when it holds no point JSON (an empty table would only fail later, by column).
    ``device`` is the GPU's name for points measured on one (scripts/gpu_width_geometry.py), else "CPU"."""
    paths = sorted(Path(root).glob(pattern))
    if not paths:
        raise FileNotFoundError(f"no geometry points ({pattern}) under {Path(root).resolve()} "
                                "(scripts/measure_geometry.py writes them)")
    rows = []
    for path in paths:
        rec = json.loads(path.read_text())
        s, m = rec["spec"], rec["spec"]["model"]
        for dtype, r in rec["results"].items():
            rows.append({
                "point": s["name"], "ladders": tuple(s["ladders"]), "state": s["state"], "rollout": dtype,
                "seed": s["seed"], "family": m["preset"], "L": len(r["moe_layers"]), "E": r["num_experts"],
                "k": r["top_k"], "H": m["hidden_size"], "F": m["moe_intermediate_size"],
                "device": rec.get("device", {}).get("name", "CPU"), "share": r["all/share"], "share_lo": r["all/share_lo"],
                "share_hi": r["all/share_hi"], "independence": r["all/independence"],
                "independence_lo": r["all/independence_lo"], "independence_hi": r["all/independence_hi"],
                "p_mean": r["all/p_mean"], "p_lo": r["all/p_mean_lo"], "p_hi": r["all/p_mean_hi"],
                "share_response": r["response/share"], "tokens": r["all/tokens"], "seqs": r["all/seqs"],
                "k3": r["native/k3"], "k3_r3": r["r3/k3"], "F2": r["native/extreme_gt2"], "F2_r3": r["r3/extreme_gt2"],
                "F1.5": r["native/extreme_gt1.5"], "F1.5_r3": r["r3/extreme_gt1.5"],
                "k3_ratio": r.get("r3/k3_ratio"), "k3_ratio_lo": r.get("r3/k3_ratio_lo"),
                "k3_ratio_hi": r.get("r3/k3_ratio_hi"), "p_layer": {int(k): v for k, v in r["p_layer"].items()},
                "seconds": rec["seconds_total"], "policy": rec["policy"],
                "sft_steps": ((rec.get("policy") or {}).get("warm_start") or {}).get("steps"),
                "sft_pass1": (((rec.get("policy") or {}).get("warm_start") or {}).get("test_accuracy") or {}).get("pass1"),
                # another SFT of the same data (scripts/gpu_width_geometry.py --sft-seed); None: the data seed's
                "sft_seed": ((rec.get("policy") or {}).get("warm_start") or {}).get("init_seed"),
                "response_length": r["response_length_mean"],
                "kernels": r["kernels"], "prompts": r["prompts"], "group_size": r["group_size"]})
    return pd.DataFrame(rows)


def ladder(df: pd.DataFrame, name: str, dtype: str = "bf16") -> pd.DataFrame:
    """The random-init bf16 points of one ladder, sorted by its factor (the base point included)."""
    sel = df[(df.rollout == dtype) & (df.state == "random") & (df.seed == 0)
             & df.ladders.apply(lambda ls: name in ls) & (df.family == "qwen3_moe")]
    return sel.sort_values(FACTORS[name])


def sft_depth(df: pd.DataFrame) -> pd.DataFrame:
    """The depth ladder with trained routers: the 400-step SFT points at 8 / 16 MoE layers and the base's."""
    sel = df[(df.rollout == "bf16") & (df.ladders.apply(lambda ls: "depth_sft" in ls)
                                       | (df.point == "state_qwen3_warm400"))]
    return sel.sort_values("L")


# The trained width ladder enters the fits (and so the trained anchors' extrapolation) once every registered
# point is measured: hidden 64 (the base), 128 and 256 (experiments/06_routing_geometry/analysis.yaml). A slope
# through two points leaves no residual to estimate its error from, so its interval would show only sampling noise.
TRAINED_WIDTH_POINTS = 3


def fits(df: pd.DataFrame) -> dict:
    """Per ladder: the log-log fit of p_mean against its factor (needs >= 2 points); ``depth_sft`` is the
    depth ladder with SFT'd routers."""
    out = {}
    for name, col in FACTORS.items():
        sel = ladder(df, name)
        if len(sel) >= 2:
            out[name] = fit_loglinear(sel[col].to_numpy(), sel["p_mean"].to_numpy())
    sel = sft_depth(df)
    if len(sel) >= 2:
        out["depth_sft"] = fit_loglinear(sel["L"].to_numpy(), sel["p_mean"].to_numpy())
    sel = sft_width(df)
    if len(sel) >= TRAINED_WIDTH_POINTS:
        out["width_sft"] = fit_loglinear(sel["H"].to_numpy(), sel["p_mean"].to_numpy())
    return out


def sft_width(df: pd.DataFrame) -> pd.DataFrame:
    """The width ladder with trained routers: the 400-step SFT points at hidden 128 / 256 and the base's (64)."""
    sel = df[(df.rollout == "bf16") & (df.ladders.apply(lambda ls: "width_sft" in ls)
                                       | (df.point == "state_qwen3_warm400"))]
    return sel.sort_values("H") if sel.ladders.apply(lambda ls: "width_sft" in ls).any() else sel.iloc[:0]


def gpu_reference_point(gpu: pd.DataFrame) -> pd.Series:
    """The GPU point that stands for the real width: the widest bf16 point, and at that width the longest
    supervised warm start (the CPU's trained ladder is 400 steps, so that point compares like with like),
    of the SFTs from the data seed (the CPU's) where there are any."""
    bf16 = gpu[gpu.rollout == "bf16"] if "rollout" in gpu else gpu
    first = default_sft(bf16)
    bf16 = first if len(first) else bf16
    steps = bf16.sft_steps.fillna(0) if "sft_steps" in bf16 else 0
    return bf16.assign(_steps=steps).sort_values(["H", "_steps"]).iloc[-1].drop("_steps")


def default_sft(points: pd.DataFrame) -> pd.DataFrame:
    """The points whose SFT ran from the data seed (every CPU point; a GPU run without --sft-seed)."""
    return points[points.sft_seed.isna()] if "sft_seed" in points else points


def other_sfts(points: pd.DataFrame) -> pd.DataFrame:
    """The points whose SFT ran from another seed (scripts/gpu_width_geometry.py --sft-seed)."""
    return points[points.sft_seed.notna()] if "sft_seed" in points else points.iloc[:0]


def point_row(df: pd.DataFrame, point: str, dtype: str = "bf16") -> pd.Series | None:
    sel = df[(df.point == point) & (df.rollout == dtype)]
    return None if sel.empty else sel.iloc[0]


# The anchors a prediction starts from (the first point of each tuple that was measured): the base
# geometry at random init; experiment 05's geometry with trained routers (its warm start after a short
# GRPO run); the base geometry after a short SFT (the longest one measured).
ANCHORS = {"random": ("qwen3_base_L48_E128_k8_h64",), "trained": ("state_exp05_grpo30", "state_exp05_warm"),
           "sft": ("state_qwen3_warm400", "state_qwen3_warm150")}


def anchor_row(df: pd.DataFrame, anchor: str) -> pd.Series | None:
    for point in ANCHORS[anchor]:
        row = point_row(df, point)
        if row is not None:
            return row
    return None


def predict(anchor: pd.Series, fitted: dict, L: int, E: int, k: int, H: int, z: float = 1.96) -> dict:
    """Predicted p_mean and >= 1 share (independence) at a geometry, moving from the measured ``anchor``
    point along each fitted slope, with an interval (see the module docstring)."""
    log_p = math.log(anchor.p_mean)
    # the anchor's own bootstrap interval, as a standard error in log p
    var = ((math.log(anchor.p_hi) - math.log(anchor.p_lo)) / (2 * z)) ** 2
    missing = []
    for name, col in FACTORS.items():
        x, x0 = {"L": L, "E": E, "k": k, "H": H}[col], int(anchor[col])
        if x == x0:
            continue
        if name not in fitted:
            missing.append(name)
            continue
        f = fitted[name]
        d = math.log(x) - math.log(x0)
        log_p += f["b"] * d
        var += np.asarray(f["cov"])[1, 1] * d * d + f["s"] ** 2
    sd = math.sqrt(var)
    p, lo, hi = (min(math.exp(v), 1.0) for v in (log_p, log_p - z * sd, log_p + z * sd))

    def share(q):
        return 1.0 - (1.0 - q) ** L

    t_draws = _t_draws(anchor, fitted, L, E, k, H, z)
    shares = share(np.exp(np.minimum(t_draws, 0.0)))  # p_l <= 1, without overflowing exp
    lo_t, hi_t = np.percentile(shares, [2.5, 97.5])
    return {"p": p, "p_lo": lo, "p_hi": hi, "share": share(p), "share_lo": share(lo), "share_hi": share(hi),
            "share_lo_t": float(lo_t), "share_hi_t": float(hi_t), "share_p94": float((shares >= PAPER_SHARE).mean()),
            "missing": missing}


def _t_draws(anchor: pd.Series, fitted: dict, L: int, E: int, k: int, H: int, z: float, draws: int = 20000,
             seed: int = 0) -> np.ndarray:
    """Monte Carlo draws of the predicted log p: the anchor's error normal (a bootstrap over thousands of
    tokens), each used slope and each ladder's residual scatter from t with the fit's n − 2 degrees of
    freedom (at least 1)."""
    rng = np.random.default_rng(seed)
    log_p = np.full(draws, math.log(anchor.p_mean))
    log_p += rng.standard_normal(draws) * (math.log(anchor.p_hi) - math.log(anchor.p_lo)) / (2 * z)
    for name, col in FACTORS.items():
        x, x0 = {"L": L, "E": E, "k": k, "H": H}[col], int(anchor[col])
        if x == x0 or name not in fitted:
            continue
        f = fitted[name]
        df = max(int(f.get("n", 3)) - 2, 1)
        d = math.log(x) - math.log(x0)
        slope = f["b"] + math.sqrt(np.asarray(f["cov"])[1, 1]) * rng.standard_t(df, draws)
        log_p += slope * d + f["s"] * rng.standard_t(df, draws)
    return log_p


def cluster_geometries() -> dict[str, dict]:
    """Each cluster model's real routing geometry and width, from its public config."""
    out = {}
    for name in GEOMETRIES:
        s = routing_structure(name)
        out[name] = {"L": s["moe_layers"], "E": s["experts"], "k": s["top_k"], "H": public_config(name)["hidden_size"],
                     "family": s["family"]}
    return out


def predictions(df: pd.DataFrame) -> pd.DataFrame:
    """Per cluster model: measured at CPU width (random init); predicted from each anchor at CPU width
    (``<anchor>_cpu_*``) and at the model's real width (``<anchor>_real_*``)."""
    fitted = fits(df)
    rows = []
    for name, g in cluster_geometries().items():
        point = "qwen3_base_L48_E128_k8_h64" if name == "qwen3_30b_a3b" else f"cluster_{name}"
        row = {"model": LABELS[name], "geometry": name, **g}
        m = point_row(df, point)
        if m is not None:
            row.update(measured_share=m.share, measured_lo=m.share_lo, measured_hi=m.share_hi, measured_p=m.p_mean)
        for anchor in ANCHORS:
            a = anchor_row(df, anchor)
            if a is None:
                continue
            row[f"{anchor}_anchor"] = a.point
            slopes = dict(fitted)
            if anchor != "random" and "depth_sft" in fitted:  # trained routers move along the trained depth slope
                slopes["depth"] = fitted["depth_sft"]
            if anchor != "random" and "width_sft" in fitted:  # and along the trained width slope, once measured
                slopes["width"] = fitted["width_sft"]
            for tag, H in (("cpu", 64), ("real", g["H"])):
                pr = predict(a, slopes, g["L"], g["E"], g["k"], H)
                row.update({f"{anchor}_{tag}_{k}": v for k, v in pr.items() if k != "missing"})
                row[f"{anchor}_{tag}_missing"] = ",".join(pr["missing"])
        rows.append(row)
    return pd.DataFrame(rows)


# -- figures ----------------------------------------------------------------------------------------
def figure_ladders(df: pd.DataFrame):
    """>= 1-layer share (top) and mean per-layer flip probability (bottom) against each ladder's factor."""
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    fitted = fits(df)
    preds = predictions(df)
    fig, axes = plt.subplots(2, 4, figsize=(15, 7), sharey="row")
    xlabel = {"depth": "MoE layers L", "experts": "routed experts E (top-8)", "topk": "top-k",
              "width": "hidden size H (expert FFN H/2)"}
    for j, (name, col) in enumerate(FACTORS.items()):
        sel = ladder(df, name)
        top, bot = axes[0, j], axes[1, j]
        if not sel.empty:
            x = sel[col].to_numpy()
            top.errorbar(x, sel.share, yerr=[sel.share - sel.share_lo, sel.share_hi - sel.share], fmt="o", color="C0",
                         capsize=3, label="measured (95 % CI, sequences)")
            top.plot(x, sel.independence, "x", color="C1", label="independence 1 - prod(1 - p_l)")
            bot.errorbar(x, sel.p_mean, yerr=[sel.p_mean - sel.p_lo, sel.p_hi - sel.p_mean], fmt="o", color="C0",
                         capsize=3, label="mean p_l measured")
        if name in fitted:
            f = fitted[name]
            lo_x = min(sel[col].min(), BASE[col]) if not sel.empty else BASE[col]
            hi_x = max(sel[col].max(), BASE[col])
            if name == "depth":
                hi_x = max(hi_x, 61)
                top.set_xlim(6.5, 75)
                bot.set_xlim(6.5, 75)
            if name == "experts":
                hi_x = max(hi_x, 384)
            xs = np.geomspace(lo_x, hi_x, 50)
            p = np.exp(f["a"] + f["b"] * np.log(xs))
            L = xs if name == "depth" else BASE["L"]
            bot.plot(xs, p, "-", color="C2", label="fit p ~ x^b (log-log)")
            bot.text(0.05, 0.9, f"b = {f['b']:+.3f} ± {math.sqrt(f['cov'][1][1]):.1g}", transform=bot.transAxes,
                     fontsize=8, color="C2")
            # its own colour: the share this fit implies, not a second fit of the same kind as the one below
            top.plot(xs, 1 - (1 - np.minimum(p, 1)) ** L, "-", color="C4", label="share implied by the p_l fit (independence)")
        top.axhline(PAPER_SHARE, color="k", ls="--", lw=1, label="R3 paper, Qwen3-30B-A3B: 94 %")
        top.set_xscale("log")
        bot.set_xscale("log")
        bot.set_yscale("log")
        bot.set_xlabel(xlabel[name])
        top.set_title(f"{name} ladder (others at 48 x 128, top-8, h64)", fontsize=9)
        for ax in (top, bot):
            ax.set_xticks(sorted(set(sel[col].tolist())) if not sel.empty else [BASE[col]])
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(alpha=0.3)
    # the cluster geometries, measured at hidden 64, on the depth panel (x = their MoE layers)
    ax = axes[0, 0]
    legend_lines = []
    for i, (_, r) in enumerate(preds.iterrows()):
        if "measured_share" in r and r.measured_share == r.measured_share:
            tag = r.model[0]  # Q, M, D, K
            ax.plot(r.L, r.measured_share, "s", color="C3", ms=5)
            # neighbours (DeepSeek-V3 at 58 layers, Kimi-K2 at 60) alternate above and below their point
            ax.annotate(tag, (r.L, r.measured_share), fontsize=7, color="C3", xytext=(3, -11 if i % 2 else 4),
                        textcoords="offset points")
            legend_lines.append(f"{tag}: {r.model} ({r.L} MoE x {r.E}, top-{r.k}) {100 * r.measured_share:.1f} %")
    ax.text(0.97, 0.04, "\n".join(legend_lines), transform=ax.transAxes, fontsize=6.5, color="C3", ha="right",
            va="bottom")
    ax.plot([], [], "s", color="C3", label="cluster geometries at h64 (measured)")
    for i, point in enumerate(ANCHORS["sft"]):
        r = point_row(df, point)
        if r is not None:
            ax.plot(r.L, r.share, "D", color="C5", ms=6)
            ax.annotate(point.replace("state_", ""), (r.L, r.share), fontsize=6.5, xytext=(6, 3 if i % 2 == 0 else -9),
                        textcoords="offset points", color="C5")
    ax.plot([], [], "D", color="C5", label="base geometry after a short SFT (measured)")
    sft = sft_depth(df)
    if len(sft) >= 2:
        for axis, key in ((axes[0, 0], "share"), (axes[1, 0], "p_mean")):
            axis.plot(sft.L, sft[key], "D--", color="C5", ms=5, lw=1,
                      label="depth ladder after a 400-step SFT" if key == "share" else None)
        f = fitted.get("depth_sft")
        if f:
            axes[1, 0].text(0.05, 0.8, f"SFT'd: b = {f['b']:+.3f} ± {math.sqrt(f['cov'][1][1]):.1g}",
                            transform=axes[1, 0].transAxes, fontsize=8, color="C5")
    axes[0, 0].set_ylabel("share of tokens with >= 1 re-routed MoE layer")
    axes[1, 0].set_ylabel("mean per-layer flip probability p_l")
    axes[0, 0].set_ylim(0, 1.05)
    h1, l1 = axes[0, 0].get_legend_handles_labels()
    h2, l2 = axes[1, 0].get_legend_handles_labels()
    fig.legend(h1 + h2[:1], l1 + l2[:1], loc="lower center", ncol=4, fontsize=8, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle("Routing mismatch vs routing geometry: bf16 rollout (emulated kernels) vs fp32 trainer, "
                 "Qwen3-MoE at CPU width, random init (brown: after SFT)", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    return fig


# Router state of each state-ladder point, as the bar labels name it.
ROUTER_STATES = {"state_exp05_random": "random init", "state_exp05_warm": "exp-05 warm start (600 SFT steps)",
                 "state_exp05_grpo30": "exp-05 warm start + 30 GRPO steps", "state_qwen3_warm150": "150-step SFT",
                 "state_qwen3_warm400": "400-step SFT", "state_qwen3_L8_warm400": "400-step SFT",
                 "state_qwen3_L16_warm400": "400-step SFT", "state_qwen3_warm400_h128": "400-step SFT",
                 "state_qwen3_warm400_h256": "400-step SFT"}


def _geometry(r) -> str:
    return f"{r.L}x{r.E} top-{r.k}" + ("" if r.H == 64 else f", hidden {r.H}")


def _measurement(rows: pd.DataFrame) -> str:
    """What one point is, from the rows' own records: the batch and its token count."""
    def one(col):
        vals = sorted({int(v) for v in rows[col]})
        return "/".join(str(v) for v in vals)

    lo, hi = rows.tokens.min() / 1000, rows.tokens.max() / 1000
    return f"one batch of {one('prompts')} prompts x {one('group_size')} samples per point ({lo:.1f}k-{hi:.1f}k tokens)"


def _rollouts(rows: pd.DataFrame) -> str:
    kernels = "/".join(sorted(set(rows.kernels)))
    names = {"bf16": "bf16", "fp8": "fp8 (W8A16)"}
    return " or ".join(names.get(d, d) for d in sorted(set(rows.rollout))) + f" rollout ({kernels} kernels)"


def router_state_points(df: pd.DataFrame) -> pd.DataFrame:
    """The state ladder's points plus, at each of its geometries without a random-init state point, the
    random-init bf16 Qwen3-MoE point of the same geometry from another ladder (seed 0); ordered by
    geometry, then random init, trained, fp8."""
    is_state = df.ladders.apply(lambda ls: "state" in ls)
    states = df[is_state]
    key = ["L", "E", "k", "H"]
    geoms = set(map(tuple, states[key].to_numpy().tolist()))
    have = set(map(tuple, states[states.state == "random"][key].to_numpy().tolist()))
    rand = df[~is_state & (df.state == "random") & (df.seed == 0) & (df.rollout == "bf16") & (df.family == "qwen3_moe")]
    rand = rand[[g in geoms and g not in have for g in map(tuple, rand[key].to_numpy().tolist())]]
    out = pd.concat([states, rand]).copy()
    out["order"] = (out.state != "random").astype(int) + 2 * (out.rollout != "bf16").astype(int)
    return out.sort_values(["E", "L", "k", "H", "order", "point"])


def figure_router_state(df: pd.DataFrame):
    """Does router state change the >= 1-layer share? Random init vs trained routers at each geometry
    the state ladder measured."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pts = router_state_points(df)
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(pts) + 2.6))
    colors = {"random": "0.55", "trained": "C0", "fp8": "C4"}
    y, labels, prev = [], [], None
    pos = 0.0
    for _, r in pts.iterrows():
        geom = _geometry(r)
        if prev is not None and geom != prev:
            pos += 0.6
            ax.axhline(pos - 0.8, color="0.8", lw=0.8)
        prev = geom
        y.append(pos)
        state = "random init" if r.state == "random" else ROUTER_STATES.get(r.point, r.state)
        labels.append(f"{geom}: {state}" + ("" if r.rollout == "bf16" else f", {r.rollout} rollout"))
        kind = "fp8" if r.rollout != "bf16" else "random" if r.state == "random" else "trained"
        ax.barh(pos, r.share, xerr=[[r.share - r.share_lo], [r.share_hi - r.share]], color=colors[kind], capsize=3,
                height=0.8)
        inside = r.share_hi > 0.62  # no room right of a long bar: write inside it
        ax.text(0.015 if inside else r.share_hi + 0.015, pos,
                f"{100 * r.share:.1f} %   mean p_l {r.p_mean:.4f}   k3 {r.k3:.1e}", va="center", fontsize=8,
                color="white" if inside else "black")
        pos += 1.0
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=9)
    ax.invert_yaxis()
    ax.axvline(PAPER_SHARE, color="k", ls="--", lw=1)
    ax.set_xlim(0, 1.02)
    ax.set_xlabel("share of tokens with >= 1 re-routed MoE layer")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=colors["random"], label="random-init routers, bf16 rollout"),
               Patch(color=colors["trained"], label="trained routers, bf16 rollout"),
               Patch(color=colors["fp8"], label="trained routers, fp8 (W8A16) rollout"),
               plt.Line2D([], [], color="k", ls="--", lw=1, label="R3 paper: 94 % (Qwen3-30B-A3B, real model)")]
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.4, -0.1), ncol=2)
    H = "/".join(str(h) for h in sorted(set(pts.H)))
    ax.set_title("Router state vs the share of tokens with >= 1 re-routed MoE layer, Qwen3-MoE routing "
                 f"(MoE layers x experts, top-k) at hidden {H}\n"
                 f"{_rollouts(pts)} vs fp32 trainer; {_measurement(pts)}\n"
                 "error bars: 95 % bootstrap interval over the sequences (2,000 resamples); "
                 "exp-05 = experiment 05's geometry and checkpoints", fontsize=9.5)
    fig.tight_layout()
    return fig


def figure_cluster_extrapolation(df: pd.DataFrame):
    """The cluster models' routing geometries: measured at hidden 64 and predicted at their real width
    from each anchor, against the paper's 94 %."""
    import matplotlib.pyplot as plt

    preds = predictions(df)
    anchor = {a: anchor_row(df, a) for a in ANCHORS}

    def at(a):
        r = anchor[a]
        return "" if r is None else f" ({r.point}: {r.L}x{r.E} top-{r.k}, h{r.H})"

    # trained anchors move along the SFT'd depth and width ladders once they were measured (see predictions)
    fitted = fits(df)
    depth = "".join(text for key, text in (("depth_sft", "; depth slope from the SFT'd depth ladder"),
                                           ("width_sft", "; width slope from the SFT'd width ladder"))
                    if key in fitted)

    fig, ax = plt.subplots(figsize=(11, 6.8))
    y = np.arange(len(preds))
    for offset, tag, color, label in (
            (-0.3, "measured", "C3", "measured at hidden 64, random init (Qwen3-MoE; the others DeepSeek-V3-family "
                                     "presets)"),
            (-0.15, "random_cpu", "C2", "fit from the random-init base" + at("random") + ", at hidden 64"),
            (0.0, "random_real", "C1", "fit from the random-init base, at the real width"),
            (0.15, "trained_real", "C0", "fit from experiment 05's trained routers" + at("trained")
             + ", at the real width" + depth),
            (0.3, "sft_real", "C5", "fit from the base after SFT" + at("sft") + ", at the real width" + depth)):
        col = "measured_share" if tag == "measured" else f"{tag}_share"
        lo = "measured_lo" if tag == "measured" else f"{tag}_share_lo_t"
        hi = "measured_hi" if tag == "measured" else f"{tag}_share_hi_t"
        if col not in preds:
            continue
        if lo not in preds:  # a fit without t-distributed slopes: its normal interval
            lo, hi = f"{tag}_share_lo", f"{tag}_share_hi"
        ax.errorbar(preds[col], y + offset, xerr=[preds[col] - preds[lo], preds[hi] - preds[col]], fmt="o",
                    color=color, capsize=3, label=label)
    ax.axvline(PAPER_SHARE, color="k", ls="--", lw=1, label="R3 paper: 94 % (Qwen3-30B-A3B, real model)")
    ax.set_yticks(y)
    ax.set_yticklabels([f"{r.model}\n{r.L}x{r.E} top-{r.k}, real hidden {r.H}" for _, r in preds.iterrows()],
                       fontsize=9)
    ax.set_ylim(len(preds) - 0.5, -0.5)
    ax.set_xlabel("share of tokens with >= 1 re-routed MoE layer")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.45, -0.1), ncol=1)
    measured = df[df.point.isin(["qwen3_base_L48_E128_k8_h64"]) | df.point.str.startswith("cluster_")]
    measured = measured[measured.rollout == "bf16"]
    ax.set_title("Does the cluster models' routing geometry alone re-route as many tokens as the R3 paper's 94 %?",
                 fontsize=11)
    fig.tight_layout()
    # The legend hangs below the axes: the caption goes under it.
    fig.canvas.draw()
    bottom = ax.get_legend().get_window_extent().transformed(fig.transFigure.inverted()).y0
    caption = ("Geometry: MoE layers x routed experts, top-k. Measured at hidden 64, then extrapolated to each model's "
               f"real width; {_rollouts(measured)} vs fp32 trainer, {_measurement(measured)}. Error bars: measured, 95 % "
               "bootstrap interval over the sequences; fits, log p_l moved from the anchor along the fitted ladder "
               "slopes, share = 1 - (1 - p_l)^L, 95 % interval with each slope drawn from its t-distribution (n - 2 "
               "degrees of freedom, n = the ladder's points), plus the anchor's interval and the ladder's residual scatter.")
    fig.text(0.01, bottom - 0.02, textwrap.fill(caption, 150), ha="left", va="top", fontsize=8, style="italic")
    return fig


def figure_flip_along_stack(df: pd.DataFrame):
    """The per-layer flip probability p_l against the MoE layer's position in the stack."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 6))
    drawn = []

    def draw(r, label, **kw):
        layers = sorted(r.p_layer)
        ax.plot(np.arange(1, len(layers) + 1), [r.p_layer[n] for n in layers], label=label, **kw)
        drawn.append(r)

    for i, (_, r) in enumerate(ladder(df, "depth").iterrows()):
        draw(r, f"Qwen3-MoE {_geometry(r)}, random init", ls="-", marker=".", ms=4, lw=1.2, color=f"C{i}")
    names = {f"cluster_{k}": v for k, v in LABELS.items()}
    for i, (_, r) in enumerate(df[(df.point.str.startswith("cluster_")) & (df.rollout == "bf16")].iterrows()):
        draw(r, f"{names.get(r.point, r.point)} preset {_geometry(r)}, random init", ls="-", lw=0.9, alpha=0.8,
             color=f"C{4 + i}")
    for style, point in zip(("-", "--"), ANCHORS["sft"]):
        r = point_row(df, point)
        if r is not None:
            draw(r, f"Qwen3-MoE {_geometry(r)}, {ROUTER_STATES.get(point, r.state)}", ls=style, lw=1.3, color="k")
    rows = pd.DataFrame(drawn)
    ax.set_xlabel("MoE layer (1 = first MoE layer)")
    ax.set_ylabel("flip probability p_l")
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Per-layer flip probability p_l along the MoE stack (share of tokens whose fp32 trainer top-k "
                 "expert set differs from the rollout's in that layer)\n"
                 f"MoE layers x routed experts, top-k at hidden {'/'.join(str(h) for h in sorted(set(rows.H)))}; "
                 f"{_rollouts(rows)} vs fp32 trainer; {_measurement(rows)}\n"
                 "each line one point's per-layer estimates, no error bars", fontsize=9.5)
    fig.tight_layout()
    return fig


def figure_gpu_width(cpu: pd.DataFrame, gpu: pd.DataFrame, note: str = ""):
    """The share of tokens with >= 1 re-routed MoE layer against hidden width, Qwen3-30B-A3B routing
    (48 MoE layers x 128 experts, top-8), bf16 rollout vs fp32 trainer: the CPU's points (emulated bf16
    kernels, hidden 64-256) beside the GPU's (the GPU's own bf16 kernels, scripts/gpu_width_geometry.py).
    ``gpu`` may be empty (nothing measured yet); ``note`` is added to the title (a smoke run says so)."""
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    def width_ffn(rows: pd.DataFrame) -> str:
        pairs = sorted({(int(h), int(f)) for h, f in zip(rows.H, rows.F)})
        if all(f == h // 2 for h, f in pairs):
            return "expert FFN H/2"
        if len({f for _, f in pairs}) == 1:
            return f"expert FFN {pairs[0][1]}"
        return "expert FFN " + ", ".join(f"{f} at {h}" for h, f in pairs)

    gpu = gpu[gpu.rollout == "bf16"].sort_values("H") if not gpu.empty else gpu
    gpu_names = sorted(set(gpu.device)) if not gpu.empty else []
    series = []
    trained_cpu, random_cpu = sft_width(cpu), ladder(cpu, "width")
    if not random_cpu.empty:
        series.append((random_cpu, f"CPU, random init, emulated bf16 ({width_ffn(random_cpu)})", "o", "0.55", "none"))
    if not trained_cpu.empty:
        series.append((trained_cpu, f"CPU, trained routers (400-step SFT), emulated bf16 ({width_ffn(trained_cpu)})",
                       "D", "C5", "C5"))
    gpu_styles = itertools.cycle([("s", "C3"), ("^", "C0"), ("v", "C2"), ("P", "C4")])  # one per (GPU, SFT length)
    others, gpu = other_sfts(gpu), default_sft(gpu)
    style_of = {}
    for (device, sft_steps), rows in (gpu.groupby([gpu.device, gpu.sft_steps]) if not gpu.empty else []):
        marker, color = style_of[device, sft_steps] = next(gpu_styles)
        series.append((rows, f"{device}: trained routers ({sft_steps:.0f}-step SFT), its own bf16 kernels "
                             f"({width_ffn(rows)})", marker, color, color))
    fig, ax = plt.subplots(figsize=(9, 6.2))
    widths = set()
    for rows, label, marker, color, face in series:
        rows = rows.sort_values("H")
        widths |= set(int(h) for h in rows.H)
        ax.errorbar(rows.H, rows.share, yerr=[rows.share - rows.share_lo, rows.share_hi - rows.share], fmt=marker + "-",
                    color=color, mfc=face, ms=6, lw=1, capsize=3, label=label)
        if "its own bf16 kernels" in label:  # the GPU's points carry their values, each series on its own side
            above = label == next(lab for _, lab, *_ in series if "its own bf16 kernels" in lab)
            for _, r in rows.iterrows():
                ax.annotate(f"{100 * r.share:.1f} %", (r.H, r.share), fontsize=8, color=color,
                            xytext=(5, 6) if above else (5, -13), textcoords="offset points")
    for (device, sft_steps), rows in (others.groupby([others.device, others.sft_steps]) if len(others) else []):
        marker, color = style_of.get((device, sft_steps)) or next(gpu_styles)
        widths |= set(int(h) for h in rows.H)
        seeds = ", ".join(str(int(x)) for x in sorted(set(rows.sft_seed)))
        ax.errorbar(rows.H, rows.share, yerr=[rows.share - rows.share_lo, rows.share_hi - rows.share], fmt=marker,
                    color=color, mfc="none", ms=8, capsize=3,
                    label=f"{device}: the same {sft_steps:.0f}-step SFT from other seeds ({seeds}): the spread between SFTs")
    ax.axhline(PAPER_SHARE, color="k", ls="--", lw=1, label="R3 paper: 94 % (Qwen3-30B-A3B, hidden 2048, real model)")
    ax.set_xscale("log", base=2)
    ticks = sorted(widths | {2048})
    ax.set_xticks(ticks)
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlim(min(ticks) / 1.3, max(ticks) * 1.3)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("hidden size H (heads H/32 of 32)")
    ax.set_ylabel("share of tokens with >= 1 re-routed MoE layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
    where = "points measured on " + ", ".join(gpu_names) if gpu_names else "no GPU point measured yet"
    ax.set_title("Re-routed share vs hidden width: bf16 rollout vs fp32 trainer, Qwen3-30B-A3B routing "
                 f"(48 MoE x 128 experts, top-8)\n{where}{note}; error bars: 95 % bootstrap over sequences",
                 fontsize=9.5)
    fig.tight_layout()
    return fig
