"""Cluster runs through wandb's public API land in the same frame as CPU runs (verl names mapped)."""
from __future__ import annotations

import pandas as pd
import pytest

from moerl.analysis.results import VERL_METRIC_MAP, MissingRunError, load_wandb_runs, map_verl_metrics
from tests_helpers import load_script


class FakeRun:
    """The attributes of wandb.apis.public.Run that the loader reads."""

    def __init__(self, run_id, name, config, history, group=None, tags=()):
        self.id, self.name, self.config, self.group, self.tags = run_id, name, config, group, list(tags)
        self._history = history

    def history(self, samples=500, pandas=True):
        return pd.DataFrame(self._history)


class FakeApi:
    def __init__(self, runs):
        self._runs, self.calls = runs, []

    def runs(self, path, filters=None):
        self.calls.append((path, filters))
        return self._runs


def test_verl_metrics_are_mapped_and_runs_keyed():
    verl_rows = [{"_step": 1, "training/global_step": 1, "rollout_corr/k3_kl": 2e-3, "critic/score/mean": 0.4,
                  "actor/pg_clipfrac": 0.01, "val-core/math/acc/mean@1": 0.5, "other/thing": 3}]
    api = FakeApi([
        FakeRun("a1", "r3-seed0", {"experiment": "02_kimi_k2_lora_grpo_r3", "arm": "r3", "seed": 0}, verl_rows),
        FakeRun("b2", "baseline", {}, verl_rows, group="01_kimi_k2_lora_grpo", tags=["arm:baseline", "seed:1"]),
    ])
    df = load_wandb_runs("me/moerl", filters={"group": "x"}, api=api)
    assert api.calls == [("me/moerl", {"group": "x"})]
    assert list(df.columns[:4]) == ["experiment", "arm", "seed", "wandb_run"]
    assert set(zip(df["experiment"], df["arm"], df["seed"])) == {("02_kimi_k2_lora_grpo_r3", "r3", 0),
                                                                  ("01_kimi_k2_lora_grpo", "baseline", 1)}
    row = df.iloc[0]
    assert row["mismatch/k3"] == 2e-3 and row["reward/mean"] == 0.4 and row["clip/frac"] == 0.01
    assert row["eval/pass1"] == 0.5 and row["step"] == 1 and row["other/thing"] == 3


def test_map_is_one_to_one_and_empty_projects_are_named():
    assert len(set(VERL_METRIC_MAP.values())) == len(VERL_METRIC_MAP)
    # two validation data sources: which is pass@1 is ambiguous, so neither is renamed
    assert "eval/pass1" not in map_verl_metrics(["val-core/a/acc/mean@1", "val-core/b/acc/mean@1"]).values()
    with pytest.raises(MissingRunError, match="no wandb runs with history at me/empty"):
        load_wandb_runs("me/empty", api=FakeApi([]))


def test_cluster_results_table_puts_the_run_beside_the_paper():
    mod = load_script("scripts/cluster_results.py", "cluster_results")
    rows = [{"_step": s, "training/global_step": s, "rollout_corr/k3_kl": k3} for s, k3 in ((1, 9.0), (2, 1e-3), (3, 3e-3))]
    runs = [FakeRun(f"r{seed}", "r3", {"experiment": "02_x", "arm": "r3", "seed": seed}, rows) for seed in (0, 1)]
    text = mod.main(["me/p", "--experiment", "02_x", "--last", "2"], api=FakeApi(runs))
    k3_row = next(line for line in text.splitlines() if line.startswith("| k3 KL"))
    assert "1.5e-3 without R3" in k3_row and "2.00e-03 ± 0.00e+00" in k3_row  # mean of the last 2 steps
    assert "| held-out pass@1 | r3 |" in text and text.count("not logged") >= 1


def test_notebooks_load_a_cluster_run_or_run_directories():
    from pathlib import Path

    from moerl.analysis.results import load_experiment

    rows = [{"_step": 1, "rollout_corr/k3_kl": 1e-3}]
    api = FakeApi([FakeRun("a", "r3", {"experiment": "03_q", "arm": "r3", "seed": 0}, rows)])
    df = load_experiment("03_q", wandb_project="me/p", api=api)
    assert api.calls == [("me/p", {"group": "03_q"})] and df["mismatch/k3"].iloc[0] == 1e-3
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "runs"
    assert set(load_experiment("00_tiny_moe_cpu", fixture)["arm"]) == {"baseline", "r3", "deepseek_r3"}
