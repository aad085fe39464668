"""docs/metrics.md: one line per logged key, generated from moerl.trainer.metric_docs; every key a recorded
run (or the test fixtures' runs) logs has a line."""
from __future__ import annotations

import json
import re
from pathlib import Path

from moerl.trainer.metric_docs import METRIC_DOCS, documented, markdown

REPO = Path(__file__).resolve().parents[2]


def _logged_keys() -> set[str]:
    keys: set[str] = set()
    files = [*(REPO / "results" / "runs").glob("*/*/seed0/metrics.jsonl"),
             *(REPO / "tests" / "fixtures").glob("**/metrics.jsonl")]
    for path in files:
        for line in path.read_text().splitlines():
            try:
                keys |= set(json.loads(line))
            except ValueError:
                continue
    return keys


def test_every_logged_key_has_a_line():
    keys = _logged_keys()
    assert len(keys) > 90
    assert sorted(k for k in keys if documented(k) is None) == []


def test_patterns_match_layers_and_thresholds_and_nothing_else():
    assert documented("routing/agreement/layer17") == "routing/agreement/layer{N}"
    assert documented("mismatch/extreme_gt1.5") == "mismatch/extreme_gt{tau}"
    assert documented("mismatch/k4") is None and documented("routing/agreement/layerX") is None


def test_docs_metrics_md_is_the_generated_table():
    text = (REPO / "docs" / "metrics.md").read_text()
    body = re.search(r"<!-- generated:metrics begin[^\n]*\n(.*?)\n<!-- generated:metrics end -->", text, re.S)
    assert body and body.group(1) == markdown()
    assert len(markdown().splitlines()) == len(METRIC_DOCS) + 2


def test_the_glossary_defines_the_headlines_terms():
    glossary = (REPO / "docs" / "glossary.md").read_text()
    defined = {t.lower() for t in re.findall(r"^- \*\*([^*]+)\*\*", glossary, re.M)}
    terms = {term.strip() for entry in defined for term in entry.split("/")}
    for needed in ("k3", "held-out pass@1", "collapse", "regime", "ungated", "acts-on floor", "registered grid",
                   "registered", "keeps drifting", "r2", "r3 (router replay)", "tis", "mis", "icepop", "rung",
                   "emulated kernels", "bitwise", "statistical check"):
        assert needed in terms, needed
