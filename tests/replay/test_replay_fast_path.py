"""Replay's shortcuts must replay exactly what the fully checked path replays.

The shortcuts: a trace concatenated, moved or with invalid rows zeroed keeps its source's expert-id
check instead of repeating it (slices are checked again); the session reads each layer's replayed columns once; rows that cannot
repeat an expert are not searched for repeats; R3 reuses the micro-batch slice ``select`` made. Any
of them going wrong would change which experts a token is sent to, silently; so a GRPO step through
the shortcuts is compared bit for bit with the same step through the checked path.
"""
import pytest
import torch

from moerl.config import load_config
from moerl.models import routers
from moerl.replay import session as session_mod
from moerl.replay.session import RoutingSession
from moerl.replay.trace import RoutingTrace, TraceError
from moerl.trainer import grpo
from moerl.trainer.grpo import GRPOTrainer
from replay_helpers import random_trace
from tests_helpers import tiny_overrides_for


def checked_path(monkeypatch) -> None:
    """Undo every shortcut: derived traces are validated in full, replay columns are read again for
    each use, every replaced row is searched for repeats, R3 slices the batch's trace again."""
    monkeypatch.setattr(RoutingTrace, "_derived", classmethod(
        lambda cls, indices, valid, moe_layers, num_experts, top_k, rows=None:
        cls(indices, valid, moe_layers, num_experts, top_k, rows)))

    def columns_read_again(self, number, device):
        n, t = self.batch_shape
        idx, valid = self.replayed(number)
        idx, valid = idx.to(device), valid.to(device)
        return idx, valid, idx.reshape(n * t, -1), valid.reshape(-1, 1)

    monkeypatch.setattr(RoutingSession, "replay_columns", columns_read_again)
    intercept = routers.intercept_routing
    monkeypatch.setattr(session_mod, "intercept_routing",
                        lambda model, policy, may_repeat=True, read_only=False:
                        intercept(model, policy, may_repeat=True, read_only=read_only))
    monkeypatch.setattr(grpo, "_micro_batch_trace",
                        lambda replay, batch, sub, rows: None if replay is None else replay[rows])


def two_steps(arm: str, tmp_path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    overrides = tiny_overrides_for(tmp_path) + ["trainer.checkpoint_every=0", "trainer.samples_every=0",
                                                "trainer.eval_every=0", "trainer.mini_batches=2", "threads=1"]
    cfg = load_config(f"experiments/00_tiny_moe_cpu/arms/{arm}.yaml", overrides)
    trainer = GRPOTrainer(cfg, tmp_path / arm, progress=False)
    try:
        timings = ("time/", "refit/seconds")
        metrics = [{k: v for k, v in trainer.step().items() if not k.startswith(timings)} for _ in range(2)]
        return metrics, {n: p.detach().clone() for n, p in trainer.trainable.items()}
    finally:
        trainer.close()


@pytest.mark.parametrize("arm", ["r3", "r2", "deepseek_r3"])
def test_shortcuts_replay_bit_identically_to_the_checked_path(arm, tmp_path, monkeypatch):
    fast_metrics, fast_weights = two_steps(arm, tmp_path / "fast")
    checked_path(monkeypatch)
    checked_metrics, checked_weights = two_steps(arm, tmp_path / "checked")
    assert fast_metrics[0]["replay/checked_rows"] > 0 and fast_metrics[0]["replay/violations"] == 0
    for fast, checked in zip(fast_metrics, checked_metrics):
        assert fast.keys() == checked.keys()
        differ = {k for k in fast if fast[k] != checked[k] and fast[k] == fast[k]}  # NaN == NaN here
        assert not differ, {k: (fast[k], checked[k]) for k in differ}
    for name, weight in fast_weights.items():
        assert torch.equal(weight, checked_weights[name]), name


def test_derived_traces_keep_the_structure_checks():
    trace = random_trace(4, 5, (1, 2), 8, 2)
    part = trace[torch.tensor([2, 0])].truncate_tokens(3)
    assert torch.equal(part.indices, trace.indices[[2, 0], :3]) and part.sample(0) == 2
    with pytest.raises(TraceError, match=r"must be \[N, T, L_moe, k\]"):
        trace[1]  # one sample without its batch dimension is not a trace
    other = RoutingTrace(trace.indices[:, :, :1], trace.valid, (1,), 8, 2)
    with pytest.raises(TraceError, match="layers"):
        RoutingTrace.cat([trace, other])


def test_a_trace_with_a_repeated_expert_never_reaches_replay():
    # The session's policy is allowed to skip the search for repeated experts because no trace can
    # hold a valid row that repeats one: construction refuses it, and derived traces keep the rows.
    idx = random_trace(2, 3, (1,), 8, 2, valid=torch.ones(2, 3, dtype=torch.bool)).indices.clone()
    idx[1, 2, 0] = idx[1, 2, 0, 1]
    with pytest.raises(TraceError, match="duplicate experts"):
        RoutingTrace(idx, torch.ones(2, 3, dtype=torch.bool), (1,), 8, 2)


def test_a_read_only_policy_cannot_replace_experts():
    from replay_helpers import random_ids, small_model

    model = small_model("qwen3_moe")
    with pytest.raises(RuntimeError, match="read-only routing policy"):
        with torch.no_grad(), routers.intercept_routing(model, lambda layer, idx, logits: idx, read_only=True):
            model(random_ids(2, 3))
