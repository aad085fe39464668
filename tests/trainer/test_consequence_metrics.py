import math

import pytest
import torch

from moerl.replay.trace import RoutingTrace
from moerl.trainer.metrics import AgreementAlarm, extreme_token_curve, paired_replay_effect, routing_divergence


def trace(idx, valid):
    return RoutingTrace(torch.tensor(idx, dtype=torch.uint8), torch.tensor(valid), (1, 3, 4), 8, 2)


def test_routing_divergence_counts_tokens_not_layers_and_ignores_column_order():
    # 1 sample, 4 tokens, 3 MoE layers, top-2.
    rollout = [[[[0, 1], [2, 3], [4, 5]]] * 4]
    native = [[[[1, 0], [2, 3], [4, 5]],   # same sets (order swapped): no difference
               [[0, 2], [2, 3], [4, 5]],   # differs in 1 layer
               [[0, 2], [3, 4], [4, 6]],   # differs in all 3 layers
               [[7, 6], [7, 6], [7, 6]]]]  # differs everywhere, but the row is invalid
    valid = [[True, True, True, False]]
    m = routing_divergence(trace(native, valid), trace(rollout, valid))
    assert m["routing/any_layer_differs"] == pytest.approx(2 / 3)
    assert m["routing/differing_layers_mean"] == pytest.approx((0 + 1 + 3) / 3)
    with pytest.raises(ValueError, match="native layers"):
        routing_divergence(RoutingTrace(torch.tensor(native, dtype=torch.uint8), torch.tensor(valid), (0, 1, 2), 8, 2),
                           trace(rollout, valid))


def test_extreme_token_curve_is_symmetric_in_the_ratio():
    rollout = torch.zeros(1, 6)
    # ratios pi_trainer/pi_rollout: 1, 1.6, 1/1.6, 3, 1/6, and one masked token with ratio 100
    trainer = torch.log(torch.tensor([[1.0, 1.6, 1 / 1.6, 3.0, 1 / 6, 100.0]]))
    mask = torch.tensor([[True, True, True, True, True, False]])
    f = extreme_token_curve(trainer, rollout, mask)
    assert f == {"mismatch/extreme_gt1.5": pytest.approx(4 / 5), "mismatch/extreme_gt2": pytest.approx(2 / 5),
                 "mismatch/extreme_gt5": pytest.approx(1 / 5), "mismatch/extreme_gt10": 0.0}


def test_paired_replay_effect_ratio_and_interval():
    g = torch.Generator().manual_seed(0)
    rollout = torch.randn(64, 10, generator=g) - 2
    mask = torch.rand(64, 10, generator=g) < 0.8
    noise = 0.05 * torch.randn(64, 10, generator=g)
    replayed = rollout + noise
    native = rollout + 2 * noise  # twice the log-ratio: ~4x the k3 for small deltas
    m = paired_replay_effect(replayed, native, rollout, mask, resamples=500, seed=1)
    assert 3.5 < m["replay_effect/k3_ratio"] < 4.1
    assert m["replay_effect/k3_ratio_lo"] < m["replay_effect/k3_ratio"] < m["replay_effect/k3_ratio_hi"]
    same = paired_replay_effect(replayed, replayed, rollout, mask, resamples=200)
    assert same["replay_effect/k3_ratio"] == pytest.approx(1.0)
    assert same["replay_effect/k3_ratio_lo"] == pytest.approx(1.0) and same["replay_effect/seqs"] == 64


def test_agreement_alarm_fires_only_far_below_the_reference(caplog):
    alarm = AgreementAlarm(3.0)
    assert alarm.check(0.02, step=1) == {}  # no reference yet
    alarm.observe_reference(0.97)  # 3 % of rows disagree without replay
    assert alarm.check(0.99, step=2)["routing/agreement_alarm"] == 0.0  # replay lowered it: healthy
    assert alarm.check(0.915, step=2)["routing/agreement_alarm"] == 0.0  # 8.5 % <= 3 x 3 % + 1 %
    with caplog.at_level("WARNING"):
        out = alarm.check(0.68, step=3)  # 32 % disagree: another layer's routes
    assert out == {"routing/agreement_alarm": 1.0, "routing/agreement_reference": 0.97}
    assert "step 3: routing agreement under replay 0.680" in caplog.text
    alarm.observe_reference(math.nan)  # a batch without valid rows keeps the last reference
    assert alarm.reference == 0.97
