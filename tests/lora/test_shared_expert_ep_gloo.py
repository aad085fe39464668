"""Megatron-Bridge's shared expert adapter under EP, replayed on gloo (CPU, 2 processes).

Bridge 0.6.x builds one shared adapter per grouped expert linear *on each EP rank*,
broadcasts it from EP rank 0 when it is built and all-reduces its gradient over the EP group
before the expert-data-parallel reduction (peft/utils.py ParallelLinearAdapter
``_synchronize_shared_expert_parameters``, ``_allreduce_shared_expert_grad``). This replays one
training step of an MoE layer with a shared LoRA under EP=2 that way, exports it to per-expert
names as Bridge does (``moerl.lora.sharding.bridge_export_expert_factor``) and compares with the
same step on the unsharded layer. Without the synchronisation (Bridge 0.5.x has no broadcast; 0.6.x's
gradient hook sees a dummy gradient under gradient-accumulation fusion) each EP rank trains
its own adapter, the export gives experts of different ranks different adapters, and the model
is no longer "one adapter per MoE layer": the second case checks that this is detected.
"""
from __future__ import annotations


import pytest
import torch

from gloo_ranks import run_ranks

E, H, OUT, R, T, LR = 4, 8, 6, 2, 24, 0.5


def _data(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(E, OUT, H, generator=g), "x": torch.randn(T, H, generator=g),
            "expert": torch.randint(0, E, (T,), generator=g), "c": torch.randn(T, OUT, generator=g),
            "a": torch.randn(R, H, generator=g), "b": torch.randn(OUT, R, generator=g)}


def _loss(d: dict, a: torch.Tensor, b: torch.Tensor, experts: range) -> torch.Tensor:
    """sum over the tokens routed to ``experts`` of <c, W_e x + B A x>."""
    total = torch.zeros(())
    for e in experts:
        tok = d["expert"] == e
        y = d["x"][tok] @ d["w"][e].T + (d["x"][tok] @ a.T) @ b.T
        total = total + (y * d["c"][tok]).sum()
    return total


def _reference_step(d: dict) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = d["a"].clone().requires_grad_(), d["b"].clone().requires_grad_()
    _loss(d, a, b, range(E)).backward()
    return (a - LR * a.grad).detach(), (b - LR * b.grad).detach()


def _rank_main(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    out = {sync: _ep_step(dist, rank, world, sync) for sync in (True, False)}
    if rank == 0:
        torch.save(out, path)
    dist.destroy_process_group()


def _ep_step(dist, rank: int, world: int, sync: bool):
    """One SGD step of the shared adapter on this EP rank; returns each factor all-gathered over EP."""
    from moerl.lora.sharding import local_experts

    d = _data()
    # each EP rank builds its own copy; rank 1 starts from a different init, as separately seeded ranks do
    a = (d["a"] if rank == 0 else d["a"] + 0.3).clone()
    b = (d["b"] if rank == 0 else d["b"] - 0.2).clone()
    if sync:  # Bridge: broadcast from EP rank 0 at construction, then sum grads over EP
        dist.broadcast(a, src=0), dist.broadcast(b, src=0)
    a.requires_grad_(), b.requires_grad_()
    if sync:
        for p in (a, b):
            p.register_hook(lambda g: (dist.all_reduce(g), g)[1])
    _loss(d, a, b, local_experts(E, world, rank)).backward()
    new = [(p - LR * p.grad).detach().contiguous() for p in (a, b)]
    gathered = []
    for t in new:  # Bridge's export all-gathers each factor over EP
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        gathered.append(parts)
    return gathered


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    """{synchronised?: [gathered A, gathered B]} from one 2-process gloo run."""
    path = str(tmp_path_factory.mktemp("ep") / "gathered.pt")
    run_ranks(_rank_main, (path,), "shared expert adapter under EP")
    return torch.load(path)


def test_synchronised_shared_adapter_is_one_adapter_per_layer_whatever_the_ep(gathered):
    from moerl.lora.sharding import Layout, ShardSpec, bridge_export_expert_factor, unshard

    ref_a, ref_b = _reference_step(_data())
    ga, gb = gathered[True]
    # the EP ranks' copies agree (unshard raises on diverged replicas) and equal the EP=1 step
    spec = ShardSpec(expert_dim=0, shared=True)
    for g, ref in ((ga, ref_a), (gb, ref_b)):
        one = unshard({(r, 0): t[None] for r, t in enumerate(g)}, spec, Layout(ep=2), "shared factor")
        assert torch.allclose(one[0], ref, atol=1e-5)
    # vLLM receives that one adapter under every expert name
    exported = bridge_export_expert_factor(ga, E)
    assert exported.shape == (E, R, H) and all(torch.equal(exported[e], exported[0]) for e in range(E))


def test_without_the_ep_sync_each_rank_trains_its_own_adapter(gathered):
    from moerl.lora.sharding import Layout, ShardingError, ShardSpec, bridge_export_expert_factor, unshard

    ga, _ = gathered[False]
    with pytest.raises(ShardingError, match="replicated over EP"):
        unshard({(r, 0): t[None] for r, t in enumerate(ga)}, ShardSpec(expert_dim=0, shared=True), Layout(ep=2))
    exported = bridge_export_expert_factor(ga, E)
    assert torch.equal(exported[0], exported[1]) and not torch.equal(exported[1], exported[2])  # per EP rank
