"""Policy-loss variants against hand-worked examples, invariants, gradient routing, config checks."""
import math
from pathlib import Path

import pytest
import torch

from moerl.config import ConfigError, LossConfig, load_config
from moerl.trainer.losses import (VARIANTS, aggregate, aggregation_weight, check_finite,
                                  policy_loss, rollout_correction)

# A 2-sample batch whose correction ratios rho_t = pi_old/pi_rollout are chosen by hand.
# Sample 0: 3 response tokens, rho = [1, 3, 0.25], advantage +1.
# Sample 1: 2 response tokens, rho = [0.6, 6], advantage -2; its last column is padding.
# logp == old_logp, so the PPO ratio is 1 and each token's unweighted loss is -A.
RHO = torch.tensor([[1.0, 3.0, 0.25], [0.6, 6.0, 1.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
ROLLOUT = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, -2.5, -0.1]])
OLD = ROLLOUT + RHO.log()
N_TOK = 5
REPO = Path(__file__).resolve().parents[2]


def run(variant, logp=None, **kw):
    cfg = LossConfig(variant=variant, **kw)
    logp = (OLD.clone() if logp is None else logp).requires_grad_(True)
    loss, metrics = policy_loss(logp, OLD, ROLLOUT, ADV, MASK, cfg)
    loss.backward()
    return float(loss.detach()), metrics, logp.grad


def tok_loss(w0, w1):
    """token-mean loss when sample 0 tokens get weights w0 and sample 1 tokens w1 (ratio 1)."""
    return (sum(-1.0 * w for w in w0) + sum(2.0 * w for w in w1)) / N_TOK


def test_tis_token_hand_worked():
    loss, m, grad = run("tis", tis_cap=2.0)
    # w = min(rho, 2): [1, 2, 0.25] and [0.6, 2]
    assert loss == pytest.approx(tok_loss([1, 2, 0.25], [0.6, 2]), rel=1e-5)
    assert m["is/truncated_frac"] == pytest.approx(2 / 5)
    assert m["is/mean"] == pytest.approx((1 + 3 + 0.25 + 0.6 + 6) / 5, rel=1e-5)
    assert m["is/max"] == pytest.approx(6.0, rel=1e-5)
    assert m["is/above_frac"] == pytest.approx(2 / 5)  # 3 and 6 above C
    assert m["is/below_frac"] == pytest.approx(1 / 5)  # 0.25 below 1/C
    w = torch.tensor([1, 2, 0.25, 0.6, 2])
    assert m["is/ess"] == pytest.approx(float(w.sum() ** 2 / (5 * (w * w).sum())), rel=1e-5)
    assert m["mask/token_frac"] == 0 and m["effective/token_frac"] == 1.0
    # d loss / d logp_t = -A_t * w_t * r_t / N_tok with r = 1
    expect = torch.tensor([[-1.0, -2.0, -0.25], [1.2, 4.0, 0.0]]) / N_TOK
    torch.testing.assert_close(grad, expect, rtol=1e-5, atol=1e-7)


def test_tis_sequence_hand_worked():
    loss, m, _ = run("tis", is_level="sequence", tis_cap=2.0)
    # prod rho: sample 0 -> 0.75, sample 1 -> 3.6 -> truncated to 2
    assert loss == pytest.approx(tok_loss([0.75] * 3, [2, 2]), rel=1e-5)
    assert m["is/truncated_frac"] == pytest.approx(2 / 5)
    assert m["is/mean"] == pytest.approx((0.75 + 3.6) / 2, rel=1e-5)  # per-sequence units


def test_mis_token_hand_worked():
    loss, m, grad = run("mis", mis_lower=0.5, mis_upper=2.0, mis_veto=None)
    # keep rho in [0.5, 2], weight rho: [1, 0, 0] and [0.6, 0]
    assert loss == pytest.approx(tok_loss([1, 0, 0], [0.6, 0]), rel=1e-5)
    assert m["mask/token_frac"] == pytest.approx(3 / 5)
    assert m["mask/seq_frac"] == 1.0 and m["mask/seq_full_frac"] == 0.0
    assert m["effective/token_frac"] == pytest.approx(2 / 5)
    assert m["effective/seq_frac"] == 1.0
    assert grad[0, 1] == 0 and grad[0, 2] == 0 and grad[1, 1] == 0  # masked: no gradient
    assert grad[0, 0] != 0 and grad[1, 0] != 0


def test_mis_sequence_hand_worked():
    loss, m, _ = run("mis", is_level="sequence", mis_lower=0.5, mis_upper=2.0, mis_veto=None)
    # prod rho 0.75 kept with weight 0.75; 3.6 rejected
    assert loss == pytest.approx(tok_loss([0.75] * 3, [0, 0]), rel=1e-5)
    assert m["mask/seq_full_frac"] == 0.5 and m["effective/seq_frac"] == 0.5


def test_mis_geometric_hand_worked():
    # geometric ratios: 0.75 ** (1/3) = 0.9086 (kept in [0.9, 1.5]); 3.6 ** (1/2) = 1.897 (rejected)
    loss, m, _ = run("mis", is_level="geometric", mis_lower=0.9, mis_upper=1.5, mis_veto=None)
    assert loss == pytest.approx(tok_loss([1, 1, 1], [0, 0]), rel=1e-5)
    assert m["is/min"] == pytest.approx(0.75 ** (1 / 3), rel=1e-5)
    assert m["is/max"] == pytest.approx(3.6 ** 0.5, rel=1e-5)
    # with token TIS on the kept sequence: min(rho_t, 2)
    loss, m, _ = run("mis", is_level="geometric", mis_lower=0.9, mis_upper=1.5, mis_veto=None,
                     mis_token_tis=True, tis_cap=2.0)
    assert loss == pytest.approx(tok_loss([1, 2, 0.25], [0, 0]), rel=1e-5)
    assert m["is/truncated_frac"] == pytest.approx(1 / 5)


def test_mis_veto_drops_whole_sequence():
    loss, m, grad = run("mis", mis_lower=0.5, mis_upper=2.0, mis_veto=0.3)
    # sample 0 has rho 0.25 < 0.3: the whole sequence goes, even its rho=1 token
    assert loss == pytest.approx(tok_loss([0, 0, 0], [0.6, 0]), rel=1e-5)
    assert m["mask/veto_seq_frac"] == 0.5
    assert torch.all(grad[0] == 0)


def test_icepop_hand_worked():
    loss, m, _ = run("icepop", icepop_alpha=0.5, icepop_beta=5.0)
    # keep rho in [0.5, 5] with weight rho: [1, 3, 0] and [0.6, 0]
    assert loss == pytest.approx(tok_loss([1, 3, 0], [0.6, 0]), rel=1e-5)
    assert m["mask/token_frac"] == pytest.approx(2 / 5)
    assert m["is/above_frac"] == pytest.approx(1 / 5) and m["is/below_frac"] == pytest.approx(1 / 5)


def test_ppo_clip_hand_worked_with_dual_clip():
    # five tokens in one row, old = 0, one advantage and ratio per token:
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    ratio = torch.tensor([[1.5, 0.5, 0.5, 4.0, 1.1]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    old = torch.zeros(1, 5)
    logp = ratio.log().requires_grad_(True)
    cfg = LossConfig(variant="ppo_clip", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    loss, m = policy_loss(logp, old, old, adv, mask, cfg)
    loss.backward()
    # token 0: A>0, r=1.5 > 1.28 -> -1.28 (clipped high); token 1: A>0, r=0.5 -> -0.5;
    # token 2: A<0, r=0.5 < 0.8 -> 0.8 (clipped low); token 3: A<0, r=4 -> max(4, 1.28)=4, dual cap 3;
    # token 4: A<0, r=1.1 -> 1.1
    assert float(loss.detach()) == pytest.approx((-1.28 - 0.5 + 0.8 + 3.0 + 1.1) / 5, rel=1e-5)
    assert m["clip/high_frac"] == pytest.approx(1 / 5)
    assert m["clip/low_frac"] == pytest.approx(1 / 5)
    assert m["clip/dual_frac"] == pytest.approx(1 / 5)
    assert m["effective/token_frac"] == pytest.approx(2 / 5)
    # gradient -A*r/5 only where unclipped
    expect = torch.tensor([[0.0, -0.5, 0.0, 0.0, 1.1]]) / 5
    torch.testing.assert_close(logp.grad, expect, rtol=1e-5, atol=1e-7)


def test_gspo_hand_worked():
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.1, 0.3, 9.0]]).requires_grad_(True)  # third column is padding
    mask = torch.tensor([[True, True, False]])
    adv = torch.ones(1, 3)
    s = math.exp(0.2)  # exp(mean(0.1, 0.3))
    cfg = LossConfig(variant="gspo", gspo_eps_low=0.3, gspo_eps_high=0.3, aggregation="seq_mean_token_mean")
    loss, m = policy_loss(logp, old, old, adv, mask, cfg)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-s, rel=1e-5)
    # value s for every token; gradient s * d log pi_t, averaged over the 2 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 2, -s / 2, 0.0]]), rtol=1e-5, atol=1e-7)
    assert m["ratio/mean"] == pytest.approx(s, rel=1e-5)
    # a tighter range clips the whole sequence: value 1 + eps, no gradient
    logp.grad = None
    cfg = LossConfig(variant="gspo", gspo_eps_low=3e-4, gspo_eps_high=4e-4)
    loss, m = policy_loss(logp, old, old, adv, mask, cfg)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(1 + 4e-4), rel=1e-6)
    assert torch.all(logp.grad == 0) and m["clip/high_frac"] == 1.0 and m["effective/token_frac"] == 0.0


def test_bypass_uses_rollout_as_old():
    torch.manual_seed(0)
    logp = OLD + 0.1 * torch.randn(2, 3)
    garbage_old = torch.full((2, 3), -7.0)  # ignored: pi_old := pi_rollout
    cfg = LossConfig(variant="bypass")
    a, ma = policy_loss(logp, garbage_old, ROLLOUT, ADV, MASK, cfg)
    b, mb = policy_loss(logp, ROLLOUT, ROLLOUT, ADV, MASK, LossConfig(variant="ppo_clip"))
    assert float(a) == pytest.approx(float(b), rel=1e-6)
    assert ma["is/max"] == pytest.approx(1.0) and ma["is/min"] == pytest.approx(1.0)


@pytest.mark.parametrize("variant,level", [("ppo_clip", "token"), ("tis", "token"), ("tis", "sequence"),
                                           ("mis", "token"), ("mis", "sequence"), ("mis", "geometric"),
                                           ("icepop", "token"), ("bypass", "token")])
def test_identical_logprobs_mean_no_correction(variant, level):
    """old == rollout: weights 1, nothing masked or truncated, loss equals plain PPO-clip."""
    torch.manual_seed(1)
    n, t = 6, 7
    rollout = -torch.rand(n, t) * 3
    mask = torch.rand(n, t) > 0.2
    mask[:, 0] = True
    logp = rollout + 0.3 * torch.randn(n, t)
    adv = torch.randn(n, 1).expand(n, t)
    cfg = LossConfig(variant=variant, is_level=level, mis_lower=0.99, mis_upper=1.01)
    loss, m = policy_loss(logp, rollout, rollout, adv, mask, cfg)
    ref, _ = policy_loss(logp, rollout, rollout, adv, mask, LossConfig(variant="ppo_clip"))
    assert float(loss.detach()) == pytest.approx(float(ref), rel=1e-6)
    assert m["is/mean"] == pytest.approx(1.0) and m["is/min"] == 1.0 and m["is/max"] == 1.0
    assert m["is/ess"] == pytest.approx(1.0) and m["is/applied_mean"] == pytest.approx(1.0)
    assert m["is/truncated_frac"] == 0 and m["mask/token_frac"] == 0 and m["mask/seq_frac"] == 0
    assert m["is/above_frac"] == 0 and m["is/below_frac"] == 0
    corr = rollout_correction(rollout, rollout, mask, cfg)
    assert torch.all(corr.weight[mask] == 1) and torch.all(corr.weight[~mask] == 0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_padding_gets_no_gradient_even_if_garbage(variant):
    torch.manual_seed(2)
    n, t = 4, 6
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[:, 4:] = False
    rollout = -torch.rand(n, t)
    old = rollout + 0.05 * torch.randn(n, t)
    logp_val = old + 0.05 * torch.randn(n, t)
    for x in (rollout, old, logp_val):
        x[~mask] = float("nan")
    logp_val[0, 5] = float("inf")
    logp = logp_val.clone().requires_grad_(True)
    loss, m = policy_loss(logp, old, rollout, torch.randn(n, 1).expand(n, t), mask, LossConfig(variant=variant))
    loss.backward()
    assert math.isfinite(float(loss.detach())) and all(math.isfinite(v) for v in m.values())
    assert torch.all(logp.grad[~mask] == 0)
    assert torch.all(torch.isfinite(logp.grad))
    assert bool((logp.grad[mask] != 0).any())


def test_non_finite_response_token_names_the_sample():
    rollout = -torch.rand(5, 4)
    mask = torch.ones(5, 4, dtype=torch.bool)
    rollout[3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"rollout_logp.*sample\(s\) \[3\].*sample 3, token 2"):
        policy_loss(torch.zeros(5, 4, requires_grad=True), torch.zeros(5, 4), rollout, torch.ones(5, 4), mask,
                    LossConfig(variant="tis"))
    mask[3, 2] = False  # the same NaN on padding is fine
    check_finite("rollout_logp", rollout, mask)
    rollout[1, 0] = -float("inf")
    mask[3, 2] = True
    with pytest.raises(ValueError, match=r"sample\(s\) \[1, 3\]"):
        check_finite("rollout_logp", rollout, mask)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_sum_constant"])
def test_aggregation_is_micro_batch_invariant(mode):
    torch.manual_seed(3)
    n, t = 8, 5
    x = torch.randn(n, t)
    mask = torch.rand(n, t) > 0.3
    mask[2] = False  # an empty row
    full = aggregate(x, mask, mode)
    parts = [(aggregate(x[i:i + 3], mask[i:i + 3], mode), aggregation_weight(mask[i:i + 3], mode))
             for i in range(0, n, 3)]
    # micro-batches of unequal size (3, 3, 2 rows), one with an empty row
    combined = sum(loss * w for loss, w in parts) / sum(w for _, w in parts)
    assert float(combined) == pytest.approx(float(full), rel=1e-6)


def test_aggregation_modes_hand_worked():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate(x, mask, "token_mean")) == pytest.approx(10 / 4)
    assert float(aggregate(x, mask, "seq_mean_token_mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(x, mask, "seq_sum_constant")) == pytest.approx(10 / 6)


@pytest.mark.parametrize("override,key", [
    ("loss.variant=tis_typo", "loss.variant"),
    ("loss.mis_lower=3.0", "loss.mis_lower"),
    ("loss.tis_cap=0", "loss.tis_cap"),
    ("loss.tis_cap=-1", "loss.tis_cap"),
    ("loss.icepop_alpha=6", "loss.icepop_alpha"),
    ("loss.mis_veto=1.5", "loss.mis_veto"),
    ("loss.dual_clip_c=0.5", "loss.dual_clip_c"),
    ("loss.eps_low=1.0", "loss.eps_low"),
    ("loss.aggregation=mean", "loss.aggregation"),
    ("loss.is_level=geo", "loss.is_level"),
])
def test_bad_loss_config_rejected_with_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in str(err.value)


def test_bad_config_messages_name_allowed_values():
    with pytest.raises(ConfigError, match=r"loss.variant.*'ppo_clip', 'tis', 'mis', 'icepop', 'gspo', 'bypass'"):
        load_config(None, ["loss.variant=foo"])
    with pytest.raises(ConfigError, match=r"loss.is_level='geometric'.*loss.variant='tis'.*\['token', 'sequence'\]"):
        load_config(None, ["loss.variant=tis", "loss.is_level=geometric"])
    with pytest.raises(ConfigError, match=r"mis_token_tis"):
        load_config(None, ["loss.variant=mis", "loss.mis_token_tis=true"])


@pytest.mark.parametrize("arm,variant", [("tis", "tis"), ("geo_mis_3pct", "mis"), ("icepop", "icepop"),
                                         ("gspo", "gspo"), ("r3_tis", "tis")])
def test_arms_load(arm, variant):
    cfg = load_config(REPO / f"experiments/00_tiny_moe_cpu/arms/{arm}.yaml")
    assert cfg.arm == arm and cfg.loss.variant == variant
    assert cfg.replay.mode == ("R3" if arm == "r3_tis" else "none")
