"""Mismatch metrics (KL estimators, perplexity gap, |dp|), entropy and per-token samples."""
import math

import numpy as np
import pytest
import torch

from moerl.config import LossConfig
from moerl.trainer.metrics import check_finite, entropy_from_logits, mismatch_metrics, token_samples

# Sample 0: two tokens with delta = log p_train - log p_rollout = [ln 2, 0];
# sample 1: one token with delta = -ln 2 (second column is padding with garbage).
ROLLOUT = torch.tensor([[math.log(0.25), math.log(0.5)], [math.log(0.8), float("nan")]])
DELTA = torch.tensor([[math.log(2.0), 0.0], [-math.log(2.0), 5.0]])
TRAIN = ROLLOUT + DELTA
MASK = torch.tensor([[True, True], [True, False]])


def test_kl_estimators_hand_worked():
    m = mismatch_metrics(TRAIN, ROLLOUT, MASK)
    l2 = math.log(2.0)
    k1 = [-l2, 0.0, l2]  # k1 = -delta
    k2 = [0.5 * l2 ** 2, 0.0, 0.5 * l2 ** 2]
    k3 = [2 - 1 - l2, 0.0, 0.5 - 1 + l2]  # e^d - 1 - d
    assert m["mismatch/k1"] == pytest.approx(sum(k1) / 3, abs=1e-6)
    assert m["mismatch/k2"] == pytest.approx(sum(k2) / 3, rel=1e-5)
    assert m["mismatch/k3"] == pytest.approx(sum(k3) / 3, rel=1e-5)
    # sequence mean: mean over sequences of each sequence's token mean
    assert m["mismatch/k3_seq_mean"] == pytest.approx(((k3[0] + k3[1]) / 2 + k3[2]) / 2, rel=1e-5)
    assert m["mismatch/k3_max"] == pytest.approx(max(k3), rel=1e-5)
    assert m["mismatch/k1_max"] == pytest.approx(l2, rel=1e-5)
    # log_ppl_diff per sequence = mean log p_rollout - mean log p_train = -mean delta
    lpd = [-(l2 + 0) / 2, l2]
    assert m["mismatch/log_ppl_diff"] == pytest.approx(sum(lpd) / 2, abs=1e-6)
    assert m["mismatch/log_ppl_abs_diff"] == pytest.approx((l2 / 2 + l2) / 2, rel=1e-5)
    assert m["mismatch/log_ppl_diff_max"] == pytest.approx(l2, rel=1e-5)
    assert m["mismatch/log_ppl_diff_min"] == pytest.approx(-l2 / 2, rel=1e-5)
    assert m["mismatch/ppl_ratio"] == pytest.approx((math.exp(-l2 / 2) + 2.0) / 2, rel=1e-5)
    # |dp|: 0.5 vs 0.25, 0.5 vs 0.5, 0.4 vs 0.8
    assert m["mismatch/dp_mean"] == pytest.approx((0.25 + 0 + 0.4) / 3, rel=1e-5)
    assert m["mismatch/dp_max"] == pytest.approx(0.4, rel=1e-5)
    assert m["mismatch/chi2_token"] == pytest.approx((4 + 1 + 0.25) / 3 - 1, rel=1e-5)
    assert m["mismatch/extreme_frac"] == 0.0  # |delta| = ln 2 is not > ln 2
    assert m["mismatch/tokens"] == 3 and m["mismatch/seqs"] == 2


def test_identical_logprobs_give_zero_mismatch():
    torch.manual_seed(0)
    lp = -torch.rand(5, 9) * 4
    mask = torch.rand(5, 9) > 0.3
    mask[:, 0] = True
    m = mismatch_metrics(lp, lp.clone(), mask)
    for key in ("k1", "k2", "k3", "k3_max", "k3_seq_mean", "log_ppl_diff", "log_ppl_abs_diff",
                "dp_mean", "dp_max", "chi2_token", "extreme_frac"):
        assert m[f"mismatch/{key}"] == 0.0, key
    assert m["mismatch/ppl_ratio"] == 1.0
    assert m["mismatch/prob_pearson"] == pytest.approx(1.0)


def test_k3_is_nonnegative_and_matches_verl():
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    torch.manual_seed(1)
    rollout = -torch.rand(6, 10) * 3
    train = rollout + 0.3 * torch.randn(6, 10)
    mask = torch.rand(6, 10) > 0.2
    mask[:, 0] = True
    ours = mismatch_metrics(train, rollout, mask)
    theirs = compute_offpolicy_metrics(train, rollout, mask.float())
    assert ours["mismatch/k3"] >= 0
    for key in ("k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min",
                "ppl_ratio", "chi2_token"):
        mine = ours["mismatch/" + ("k3" if key == "k3_kl" else key)]
        assert mine == pytest.approx(float(theirs[key]), rel=1e-4, abs=1e-6), key
    assert ours["mismatch/k1"] == pytest.approx(float(theirs["kl"]), rel=1e-4, abs=1e-6)


def test_non_finite_logprob_is_reported_not_averaged():
    rollout = ROLLOUT.clone()
    rollout[1, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"rollout_logp.*sample\(s\) \[1\]"):
        mismatch_metrics(TRAIN, rollout, MASK)
    assert check_finite is not None  # re-exported for the trainer


def test_entropy_from_logits():
    logits = torch.zeros(2, 3, 4)  # uniform over 4: entropy ln 4
    logits[1, 0] = torch.tensor([0.0, -1e9, -1e9, -1e9])  # one-hot: entropy 0
    logits[1, 2] = float("nan")  # padding
    mask = torch.tensor([[True, True, True], [True, True, False]])
    h = entropy_from_logits(logits, mask)
    assert h == pytest.approx((4 * math.log(4) + 0.0) / 5, rel=1e-6)


def test_token_samples_flags_and_subsampling():
    rollout = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    rho = torch.tensor([[1.0, 3.0, 0.25], [0.6, 6.0, 1.0]])
    trainer = rollout + rho.log()
    mask = torch.tensor([[True, True, True], [True, True, False]])
    cfg = LossConfig(variant="icepop", icepop_alpha=0.5, icepop_beta=5.0)
    s = token_samples(rollout, trainer, mask, cfg, max_tokens=100)
    assert list(s["sample"]) == [0, 0, 0, 1, 1] and list(s["token"]) == [0, 1, 2, 0, 1]
    np.testing.assert_allclose(s["raw_ratio"], [1, 3, 0.25, 0.6, 6], rtol=1e-5)
    np.testing.assert_allclose(s["is_weight"], [1, 3, 0, 0.6, 0], rtol=1e-5)
    assert list(s["masked"]) == [False, False, True, False, True]
    assert s["rollout_logp"].dtype == np.float32 and s["masked"].dtype == bool
    tis = token_samples(rollout, trainer, mask, LossConfig(variant="tis", tis_cap=2.0), max_tokens=100)
    assert list(tis["truncated"]) == [False, True, False, False, True]
    np.testing.assert_allclose(tis["is_weight"], [1, 2, 0.25, 0.6, 2], rtol=1e-5)
    g = torch.Generator().manual_seed(0)
    sub = token_samples(rollout, trainer, mask, cfg, max_tokens=3, generator=g)
    assert len(sub["sample"]) == 3
    keys = list(zip(sub["sample"], sub["token"]))
    assert keys == sorted(keys) and len(set(keys)) == 3 and all(mask[r, t] for r, t in keys)
    g2 = torch.Generator().manual_seed(0)
    again = token_samples(rollout, trainer, mask, cfg, max_tokens=3, generator=g2)
    assert list(again["token"]) == list(sub["token"])  # reproducible with a seeded generator
