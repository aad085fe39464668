"""List the experiments and their arms, each with a one-line description (as ``tune ls`` does).

    python scripts/ls.py          # every experiment: what it asks, where it runs, its launcher
    python scripts/ls.py 05       # the arms of one experiment (a prefix or full name): description
                                  # and the loss, replay and rollout settings it resolves to

Descriptions are each README's title and each arm YAML's first comment line, so
the list cannot drift from the files; the settings come from the resolved config (moerl.config).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def first_comment(path: Path, width: int = 100) -> str:
    """The first comment line of a YAML file, cut to ``width`` characters ('' if it has none)."""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            text = line.lstrip().lstrip("#").strip().rstrip(":,;")
            return text if len(text) <= width else text[: width - 1].rstrip() + "…"
    return ""


def title(experiment: Path) -> str:
    """The README's first heading without its number: '00 — LoRA GRPO on ...' -> 'LoRA GRPO on ...'."""
    readme = experiment / "README.md"
    head = readme.read_text().splitlines()[0] if readme.exists() else experiment.name
    return re.sub(r"^#\s*\d+\s*[—-]\s*", "", head).strip()


def runs_on(experiment: Path) -> tuple[str, str]:
    """Where it runs and its launcher."""
    for name in ("launch.sh", "run.sh"):
        if (experiment / name).exists():
            launcher = f"{experiment.relative_to(REPO)}/{name}"
            break
    else:
        launcher = "-"
    cluster = (experiment / "experiment.yaml").exists() or (experiment / "bringup").exists()
    if cluster:
        return "GPU cluster (verl)", launcher
    # an embedded-path experiment on a checkpoint (model.path): one GPU, or a CPU for small ones
    base = experiment / "base.yaml"
    checkpoint = base.exists() and any(line.strip().startswith("path:") for line in base.read_text().splitlines())
    return ("1 GPU or CPU (a checkpoint on disk)" if checkpoint else "CPU"), launcher


def loss_label(cfg) -> str:
    """The estimator and its band or cap, resolved from the arm's config (the name says the estimator
    where arms differ in it, ``geo_mis_3pct``, ``seq_mis``; this says every setting)."""
    lo = cfg.loss
    if lo.variant == "tis":
        return f"{lo.is_level} TIS, cap {lo.tis_cap:g}"
    if lo.variant == "mis":
        extra = f", token TIS cap {lo.tis_cap:g}" if lo.mis_token_tis else ""
        veto = f", veto {lo.mis_veto:g}" if lo.mis_veto is not None else ""
        return f"{lo.is_level} MIS [{lo.mis_lower:g}, {lo.mis_upper:g}]{veto}{extra}"
    if lo.variant == "icepop":
        return f"IcePop [{lo.icepop_alpha:g}, {lo.icepop_beta:g}]"
    if lo.variant == "gspo":
        return f"GSPO clip [1-{lo.gspo_eps_low:g}, 1+{lo.gspo_eps_high:g}]"
    return f"{lo.variant} [1-{lo.eps_low:g}, 1+{lo.eps_high:g}]"


def arm_lines(experiment: Path) -> list[str]:
    from moerl.config import former_arms, load_config

    lines = []
    for path in sorted((experiment / "arms").glob("*.yaml")):
        settings = ""
        if not runs_on(experiment)[0].startswith("GPU cluster"):  # a cluster arm is a verl config, not moerl's
            cfg = load_config(path)
            settings = (f"  [{loss_label(cfg)}; replay {cfg.replay.mode}; rollout {cfg.rollout.dtype}"
                        f"{'; ' + cfg.model.preset if cfg.model.preset != 'qwen3_moe' else ''}]")
        former = former_arms(experiment.name, path.stem)
        renamed = f" (formerly {', '.join(former)})" if former else ""
        lines.append(f"  {path.stem:26s} {first_comment(path) or '-'}{settings}{renamed}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", nargs="?", help="an experiment number or name: list its arms")
    args = ap.parse_args(argv)
    experiments = sorted(p for p in (REPO / "experiments").iterdir() if p.is_dir() and p.name[:2].isdigit())
    if args.experiment is None:
        for exp in experiments:
            where, launcher = runs_on(exp)
            arms = len(list((exp / "arms").glob("*.yaml"))) if (exp / "arms").is_dir() else 0
            print(f"{exp.name:36s} {title(exp)}\n{'':36s} {where}; {arms or 'no'} arm(s); {launcher}")
        print("\narms of one experiment: python scripts/ls.py NN")
        return 0
    match = [e for e in experiments if e.name.startswith(args.experiment)]
    if len(match) != 1:
        have = ", ".join(e.name for e in experiments)
        raise SystemExit(f"experiment {args.experiment!r}: {'ambiguous' if match else 'not found'} (have: {have})")
    exp = match[0]
    where, launcher = runs_on(exp)
    print(f"{exp.name}: {title(exp)}\n{where}; launcher {launcher}")
    if not (exp / "arms").is_dir():
        print("no arms/ (one configuration; see its README)")
        return 0
    print("\n".join(arm_lines(exp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
