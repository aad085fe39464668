"""moerl.analysis.pilots: the pilot tables and the measures 05's reading cites, from pilot directories."""
import gzip
import json

from moerl.analysis import pilots
from tests_helpers import REPO


def write_pilot(root, name, steps=300, seq_frac=1.0, k3=1e-3, differing=0.2, cut=2.0, config="baseline"):
    run = root / name
    run.mkdir(parents=True)
    rows = [{"step": 0, "eval/pass1": 0.9}]
    rows += [{"step": i + 1, "reward/mean": 0.5 if i < steps - 100 else 0.25, "mismatch/k3": k3, "mismatch/extreme_gt2": 0.0, "grad_norm": 1.0,
              "routing/any_layer_differs": 0.15, "routing/differing_layers_mean": differing,
              "replay_effect/k3_ratio": cut, "effective/seq_frac": seq_frac if i == 7 else 1.0,
              "effective/token_frac": 0.99} for i in range(steps)]
    rows.append({"step": steps, "eval/pass1": 0.8})
    with gzip.open(run / "metrics.jsonl.gz", "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
    (run / "pilot.json").write_text(json.dumps({"config": config}))
    return run


def test_search_table_names_each_pilot_without_its_experiment_prefix_and_with_its_config(tmp_path):
    run = write_pilot(tmp_path, "05_p1_bf16_lr3e-4", steps=100, config="baseline, lr 3e-4")
    lines = pilots.search_table([run])
    assert lines[2].startswith("| p1_bf16_lr3e-4 | baseline, lr 3e-4 | 100 | 0.25 → 0.25 → 0.25 → 0.25 | 1.0e-03 |")


def test_search_facts_cite_what_the_table_does_not_show(tmp_path):
    dirs = [write_pilot(tmp_path, "05_p1_bf16_lr3e-4", steps=100, k3=3e-4, cut=1.8),
            write_pilot(tmp_path, "05_p11_ds_bf16_lr3e-4", steps=100, k3=1.8e-3, cut=7.4),
            write_pilot(tmp_path, "05_p15_ds_bf16_lr3e-4_300", seq_frac=0.875)]
    text = pilots.search_facts(dirs)
    assert "p11_ds_bf16_lr3e-4 7.4×" in text and "(6×)" in text
    assert "training reward over the last 100 steps: p15_ds_bf16_lr3e-4_300 0.25" in text
    # one batch of one pilot lost a sequence: the line says so instead of "every one"
    assert "sequences keeping a gradient: at least 0.875 of a batch" in text


def test_regime_table_reads_an_archived_07_pilot():
    run = REPO / "results" / "pilots" / "07_r11_fp32_ws375_32prompts_mb2_lr3e-4_wu20"
    row = pilots.regime_table([run]).splitlines()[2]
    assert row.startswith(f"| {run.name} | 375 | per_expert | 0.0003 (20) | 32 x 8 | 2 | 300/300 |")
