"""A real multi-process torch.distributed (gloo, CPU) run of the tiny model's MoE layer under EP=2
and ETP/TP=2: each rank holds only its shard of the base experts and of the expert LoRA, computes its
part, and an all-reduce gives the unsharded layer's output (computed by transformers in the parent).
"""
from __future__ import annotations


import pytest
import torch

from gloo_ranks import run_ranks


def _rank_main(rank: int, world: int, port: int, layout_kw: dict, path: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from moerl.lora.sharding import Layout, shard, spec_for, to_local_expert_ids

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    data = torch.load(path)
    layout = Layout(**layout_kw)
    ep_rank, tp_rank = (rank, 0) if layout.ep > 1 else (0, rank)
    mine = {n: shard(t, spec_for(f"x.mlp.experts.{n}", tuple(t.shape)), layout, n)[(ep_rank, tp_rank)]
            for n, t in data["tensors"].items()}
    gate_up = mine["gate_up_proj"] + mine["gate_up_proj.lora_B"] @ mine["gate_up_proj.lora_A"] * data["scale"]
    down = mine["down_proj"] + mine["down_proj.lora_B"] @ mine["down_proj.lora_A"] * data["scale"]
    idx = to_local_expert_ids(data["index"], data["num_experts"], layout.ep, ep_rank)
    h, w = data["hidden"], data["weights"]
    out = torch.zeros_like(h)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(idx == e)
        if len(tok):
            g, u = F.linear(h[tok], gate_up[e]).chunk(2, -1)
            out.index_add_(0, tok, F.linear(F.silu(g) * u, down[e]) * w[tok, slot, None])
    dist.all_reduce(out)
    if rank == 0:
        torch.save(out, path + ".out")
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["shared_outer"])  # per-expert and shared factors both; per_expert in test_lora_sharding
def test_gloo_ep2_and_tp2_match_unsharded_moe_layer(tmp_path, mode):
    from moerl.config import ExperimentConfig
    from moerl.data.tokenizer import build_tokenizer
    from moerl.lora.peft_lora import apply_lora
    from moerl.models.presets import build_model
    from moerl.models.routers import find_moe_layers, intercept_routing
    from moerl.refit.adapter_format import AdapterMap
    from moerl.refit.weights import base_state_dict

    cfg = ExperimentConfig()
    cfg.lora.expert_mode = mode
    tok = build_tokenizer()
    model = apply_lora(build_model(cfg.model, tok), cfg.lora, cfg.model.preset)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    layer = find_moe_layers(model)[0]
    seen = {}

    def grab(module, args):
        seen["args"] = args

    def keep_out(module, args, out):
        seen["out"] = out

    h1 = layer.block.experts.register_forward_pre_hook(grab)
    h2 = layer.block.experts.register_forward_hook(keep_out)
    with torch.no_grad(), intercept_routing(model, lambda *a: None):
        model(input_ids=torch.randint(3, 30, (2, 9)))
    h1.remove(), h2.remove()
    hidden, index, weights = seen["args"]
    prefix = f"model.layers.{layer.layer_number}.mlp.experts."
    base = base_state_dict(model)
    adapter = AdapterMap(model)
    tensors = {"gate_up_proj": base[prefix + "gate_up_proj"], "down_proj": base[prefix + "down_proj"]}
    tensors.update({k[len(prefix):]: v for k, v in adapter.state().items() if k.startswith(prefix)})
    assert len(tensors) == 6
    path = str(tmp_path / "moe.pt")
    torch.save({"tensors": {k: v.contiguous() for k, v in tensors.items()}, "hidden": hidden, "index": index,
                "weights": weights, "num_experts": layer.num_experts,
                "scale": adapter.scales[prefix + "gate_up_proj"]}, path)
    for layout_kw in ({"ep": 2}, {"etp": 2}):
        run_ranks(_rank_main, (layout_kw, path), str(layout_kw))
        got = torch.load(path + ".out")
        assert torch.allclose(got, seen["out"], atol=2e-5), (layout_kw, (got - seen["out"]).abs().max())
