"""Family-wise verdicts: Holm's adjustment against its definition, and a yes that does not survive it."""
import itertools

import pytest

from moerl.analysis import familywise


def test_holm_matches_its_definition_and_keeps_order():
    p = {"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.2, "e": None}
    adjusted = familywise.holm(p)
    ranked = sorted((k for k in p if p[k] is not None), key=p.get)
    m = len(ranked)
    for i, k in enumerate(ranked):  # max over j <= i of min(1, (m - j) p_(j))
        assert adjusted[k] == pytest.approx(max(min(1, (m - j) * p[ranked[j]]) for j in range(i + 1)))
    assert adjusted["e"] is None
    assert adjusted == {"a": 0.04, "c": pytest.approx(0.09), "b": pytest.approx(0.09), "d": 0.2, "e": None}
    for x, y in itertools.combinations(ranked, 2):
        assert adjusted[x] <= adjusted[y]


def test_a_yes_reads_yes_only_when_it_survives_the_family():
    verdicts = {"r3 helps": {"verdict": "yes", "p": 0.0267}, "tis helps": {"verdict": "yes", "p": 0.001},
                "r3 like": {"verdict": "inconclusive", "p": 0.11}, "gated": {"verdict": "not tested", "p": 0.0001}}
    out = familywise.apply(verdicts)
    assert out["tis helps"]["verdict_holm"] == "yes"
    assert out["r3 helps"]["verdict_holm"] == "inconclusive"  # 0.0267 x 3 = 0.08
    assert out["gated"]["verdict_holm"] == "not tested" and out["r3 like"]["verdict_holm"] == "inconclusive"
    assert out["r3 helps"]["family_size"] == 4


def test_p_values_of_each_rule_kind():
    assert familywise.sign_p(5, 5) == pytest.approx(1 / 32)
    assert familywise.sign_p(0, 5) == 1.0
    assert familywise.fisher_p(10, 10, 0, 10) == pytest.approx(1 / 184756)  # C(20, 10)
    assert familywise.fisher_p(0, 10, 10, 10) == 1.0
    assert familywise.t_p([0.1, 0.2, 0.3], 0.0) < 0.05 < familywise.t_p([-0.1, 0.1, 0.05], 0.0)
    assert familywise.welch_p([2.0, 2.1, 1.9, 2.2], [1.0, 1.1, 0.9]) < 0.001
    assert familywise.t_p([0.1], 0.0) is None and familywise.welch_p([1.0], [1.0, 2.0]) is None
