"""The checkpoint check on checkpoints that 2 gloo EP ranks write (CPU, spawned processes).

Each EP rank trains its copy of a shared expert adapter for one step (Megatron-Bridge's way: broadcast
from EP rank 0, gradient summed over EP; or, broken, neither), then both write one PyTorch distributed
checkpoint together (Megatron-Core's torch_dist format is one) with the adapter on the global expert
axis, each rank's copy in the slots of its own experts as Bridge's ``sharded_state_dict`` lays it out.
The healthy checkpoint passes; the drifted one fails with the check's name and the differing slots.
"""
from __future__ import annotations

import datetime

import torch

from gloo_ranks import run_ranks

E, H, OUT, R, T, LR, EP = 4, 8, 6, 2, 24, 0.5, 2
PREFIX = "decoder.layers.1.mlp.experts.linear_fc1.adapter"


def _data(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(E, OUT, H, generator=g), "x": torch.randn(T, H, generator=g),
            "expert": torch.randint(0, E, (T,), generator=g), "c": torch.randn(T, OUT, generator=g),
            "a": torch.randn(R, H, generator=g), "b": torch.randn(OUT, R, generator=g)}


def _loss(d: dict, a, b, experts) -> torch.Tensor:
    total = torch.zeros(())
    for e in experts:
        tok = d["expert"] == e
        total = total + (((d["x"][tok] @ d["w"][e].T) + (d["x"][tok] @ a.T) @ b.T) * d["c"][tok]).sum()
    return total


def _rank_main(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from moerl.lora.sharding import local_experts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    d = _data()
    mine = local_experts(E, world, rank)
    for synced in (True, False):
        # each EP rank builds its own copy from its own seed (rank 1 starts elsewhere)
        a = (d["a"] if rank == 0 else d["a"] + 0.3).clone()
        b = (d["b"] if rank == 0 else d["b"] - 0.2).clone()
        if synced:
            dist.broadcast(a, src=0), dist.broadcast(b, src=0)
        a.requires_grad_(), b.requires_grad_()
        if synced:
            for p in (a, b):
                p.register_hook(lambda g: (dist.all_reduce(g), g)[1])
        _loss(d, a, b, mine).backward()
        state = {}
        for key, p in ((f"{PREFIX}.linear_in.weight", a), (f"{PREFIX}.linear_out.weight", b)):
            copy = (p - LR * p.grad).detach()
            local = copy.unsqueeze(0).repeat(len(mine), *([1] * copy.ndim)).contiguous()  # this rank's slots
            state[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        dcp.save(state, checkpoint_id=f"{root}/{'healthy' if synced else 'drifted'}")
    dist.destroy_process_group()


def test_shared_expert_checkpoint_check_on_gloo_ep2(tmp_path):
    from moerl.verl_ext.checkpoint_check import check_shared_expert_copies, read_checkpoint

    run_ranks(_rank_main, (str(tmp_path),), "shared expert checkpoint under EP=2")

    healthy = read_checkpoint(tmp_path / "healthy")
    a = healthy[f"{PREFIX}.linear_in.weight"]
    assert a.shape == (E, R, H)
    # the checkpoint holds the real EP=1 step: one SGD step of the shared adapter on every expert's tokens
    d = _data()
    ref_a, ref_b = d["a"].clone().requires_grad_(), d["b"].clone().requires_grad_()
    _loss(d, ref_a, ref_b, range(E)).backward()
    assert torch.allclose(a[3], (ref_a - LR * ref_a.grad).detach(), atol=1e-5)
    verdict = check_shared_expert_copies(healthy, ep=EP)
    assert verdict.ok, verdict.detail

    drifted = check_shared_expert_copies(read_checkpoint(tmp_path / "drifted"), ep=EP)
    assert not drifted.ok and drifted.name == "shared_expert_ep_copies"
    assert "linear_in.weight: expert slots 2-3 differ from slot 0 (EP ranks [1] vs EP rank 0)" in drifted.detail


def test_checkpoint_check_reads_files_and_refuses_what_it_cannot_check(tmp_path):
    from safetensors.torch import save_file

    from moerl.verl_ext.checkpoint_check import check_shared_expert_copies, read_checkpoint
    from moerl.verl_ext.first_steps import RunReadError

    same = torch.randn(R, H).expand(E, R, H).contiguous()
    drift = same.clone()
    drift[1] += 1e-3
    save_file({f"{PREFIX}.linear_in.weight": same}, tmp_path / "ok.safetensors")
    torch.save({"model": {f"{PREFIX}.linear_in.weight": drift}}, tmp_path / "bad.pt")
    assert check_shared_expert_copies(read_checkpoint(tmp_path / "ok.safetensors")).ok
    bad = check_shared_expert_copies(read_checkpoint(tmp_path / "bad.pt"))
    assert not bad.ok and "expert slots 1 differ from slot 0, max |diff| 0.001" in bad.detail
    nothing = check_shared_expert_copies({"decoder.layers.0.self_attention.linear_qkv.weight": same})
    assert not nothing.ok and "no shared expert adapter" in nothing.detail
    # through the checker's command line, beside a healthy run's log
    from tests_helpers import REPO, load_script

    cli = load_script("scripts/check_first_steps.py", "check_first_steps")
    run = str(REPO / "results" / "runs" / "00_tiny_moe_cpu" / "baseline" / "seed1")
    assert cli.main([run, "--checkpoint", str(tmp_path / "ok.safetensors")]) == 0
    assert cli.main([run, "--checkpoint", str(tmp_path / "bad.pt"), "--ep", "2"]) == 1
    assert cli.main([run, "--checkpoint", str(tmp_path / "absent.pt")]) == 2
    for missing in (tmp_path / "absent.pt", tmp_path):
        try:
            read_checkpoint(missing)
        except RunReadError as err:
            assert str(missing) in str(err)
        else:
            raise AssertionError(f"{missing} was read")
