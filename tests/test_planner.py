"""Planner: parameter counts vs published totals and vs transformers' own modules; fit/reject."""

import pytest
import torch

from moerl import planner
from tests_helpers import load_script

MODELS = ["kimi_k2", "deepseek_v3", "qwen3_30b_a3b", "qwen3_235b_a22b", "moonlight_16b_a3b"]

# Published figures are printed to 2-3 significant digits. Default tolerance 1 %; the exceptions
# are stated with the architecture count, which the transformers cross-check below pins exactly:
TOLERANCE = {
    # config.json gives 1,026.4B (-1.3 %); the "1.04T" of the K2 report is not reproducible from
    # the released architecture (61 layers, 1 dense, 384 x 3 x 7168 x 2048 experts).
    ("kimi_k2", "total"): 0.015,
    # "37B" / "3.3B" / "3B" are 2-significant-digit figures: 37.55B, 3.35B and 2.91B round to them.
    ("deepseek_v3", "active"): 0.016,
    ("qwen3_30b_a3b", "active"): 0.017,
    ("moonlight_16b_a3b", "active"): 0.03,
}


@pytest.mark.parametrize("name", MODELS)
def test_counts_match_published(name):
    cfg = planner.load_public_config(name)
    pc = planner.count_params(cfg)
    for kind, got in (("total", pc.total), ("active", pc.active)):
        want = cfg["_published"][f"{kind}_params"]
        tol = TOLERANCE.get((name, kind), 0.01)
        assert abs(got / want - 1) <= tol, f"{name} {kind}: {got / 1e9:.2f}B vs published {want / 1e9:.2f}B"


def _hf_config(cfg):
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    keys = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("name", "family")}
    if cfg["family"] == "deepseek_v3":
        keys.pop("num_nextn_predict_layers", None)
        return DeepseekV3Config(**keys)
    return Qwen3MoeConfig(**keys)


@pytest.mark.parametrize("name", ["moonlight_16b_a3b", "qwen3_30b_a3b", "deepseek_v3"])
def test_total_equals_transformers_model(name):
    """Independent check of the formulas (MLA, embeddings, routers): build the real transformers
    model on the meta device (no memory) and count its parameters and buffers that are weights."""
    from transformers import AutoModelForCausalLM

    cfg = planner.load_public_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(cfg))
    n = sum(p.numel() for p in model.parameters())
    n += sum(b.numel() for nm, b in model.named_buffers() if nm.endswith("e_score_correction_bias"))
    assert planner.count_params(cfg).total == n


def test_dense_first_layer_mapping():
    moon = planner.load_public_config("moonlight_16b_a3b")
    assert planner.moe_layer_indices(moon) == list(range(1, 27))
    assert planner.megatron_moe_layer_freq(moon) == [0] + [1] * 26
    assert planner.moe_layer_indices(planner.load_public_config("deepseek_v3"))[0] == 3
    assert planner.moe_layer_indices(planner.load_public_config("qwen3_30b_a3b")) == list(range(48))


def test_lora_counts_and_unmatched_targets():
    q = planner.load_public_config("qwen3_30b_a3b")
    lo = planner.count_lora_params(q, 8, ["linear_qkv"], "shared")
    assert lo.total == 48 * 8 * (2048 + (32 + 8) * 128)
    per = planner.count_lora_params(q, 8, ["linear_fc1", "linear_fc2"], "per_expert")
    shared = planner.count_lora_params(q, 8, ["linear_fc1", "linear_fc2"], "shared")
    assert per.routed_experts == 128 * shared.routed_experts
    k2 = planner.load_public_config("kimi_k2")
    assert planner.count_lora_params(k2, 8, ["linear_qkv"]).unmatched_targets == ["linear_qkv"]


def test_trace_bits_and_vllm_rank():
    k2 = planner.load_public_config("kimi_k2")
    assert planner.routing_trace_bits_per_token(k2) == 60 * 8 * 9  # ceil(log2 384) = 9
    assert planner.vllm_max_lora_rank(33) == 64 and planner.vllm_max_lora_rank(512) == 512
    with pytest.raises(planner.PlanError, match="512"):
        planner.vllm_max_lora_rank(600)


def _kimi_layout(**kw):
    base = dict(n_gpus=64, gpu_mem_gib=80, tp=8, pp=8, ep=8, rollout_tp=64, gpu_memory_utilization=0.85,
                param_offload=True, optimizer_offload=True, recompute_full=True, lora_rank=32,
                lora_targets=("linear_proj", "linear_fc1", "linear_fc2"), fully_sharded_loras=True)
    base.update(kw)
    return planner.Layout(**base)


def test_layout_that_fits_and_one_that_does_not():
    k2 = planner.load_public_config("kimi_k2")
    assert planner.plan(k2, _kimi_layout()).problems == []
    # 1T in bf16 on 8 GPUs: the expert shard alone is ~250 GiB per GPU
    bad = planner.plan(k2, _kimi_layout(n_gpus=8, pp=1, ep=8, rollout_tp=8))
    assert any("over by" in p and "trainer" in p for p in bad.problems)
    assert any("rollout" in p for p in bad.problems)


def test_adapter_refit_is_smaller_than_merged():
    p = planner.plan(planner.load_public_config("kimi_k2"), _kimi_layout())
    assert 0 < p.refit_adapter_bytes < p.refit_merged_bytes
    assert p.trace_packed_bytes < p.trace_int16_bytes


def _script(name):
    return load_script(f"scripts/{name}.py", f"_script_{name}")


def test_plan_script_exit_codes(capsys):
    plan = _script("plan")
    assert plan.main(["experiments/04_moonlight_16b_a3b_r3"]) == 0
    out = capsys.readouterr().out
    assert "params total" in out and "int16" in out and "adapter-only" in out
    rc = plan.main(["experiments/01_kimi_k2_lora_grpo", "trainer.nnodes=1",
                    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=8"])
    out = capsys.readouterr().out
    assert rc == 1 and "DOES NOT FIT" in out and "over by" in out


def test_vllm_moe_lora_slot_uses_vllm_shapes():
    """Kimi-K2 r32: separate gate/up A (2rH) + B (2 I_p r), down A (r I_p) + B (H r) per expert.
    TP64 without EP holds all 384 experts on every rank (~30 GiB); EP64 holds 6 with I unsplit."""
    cfg = planner.load_public_config("kimi_k2")
    h, i, r = cfg["hidden_size"], cfg["moe_intermediate_size"], 32
    no_ep = planner.vllm_moe_lora_elems_per_rank(cfg, r, tp=64, ep=1, fully_sharded=False)
    assert no_ep == 384 * (2 * r * h + 2 * (i / 64) * r + r * (i / 64) + h * r)
    ep = planner.vllm_moe_lora_elems_per_rank(cfg, r, tp=64, ep=64, fully_sharded=False)
    assert ep == 6 * (2 * r * h + 2 * i * r + r * i + h * r)
    fs = planner.vllm_moe_lora_elems_per_rank(cfg, r, tp=32, ep=1, fully_sharded=True)
    assert fs == 384 * (2 * (r / 32) * h + 2 * (i / 32) * r + r * (i / 32) + (h / 32) * r)
    gib_no_ep = 60 * no_ep * 2 / planner.GIB
    assert 29 < gib_no_ep < 31 and 60 * ep * 2 / planner.GIB < 1


def test_host_ram_for_offload_is_per_node_and_checked():
    cfg = planner.load_public_config("kimi_k2")
    lay = planner.Layout(n_gpus=64, gpu_mem_gib=80, tp=8, pp=8, ep=8, etp=1, rollout_tp=64, rollout_ep=64,
                         gpu_memory_utilization=0.85, param_offload=True, optimizer_offload=True, recompute_full=True,
                         lora_rank=32, lora_targets=("linear_proj", "linear_fc1", "linear_fc2"), gpus_per_node=8,
                         host_mem_gib=100)
    p = planner.plan(cfg, lay)
    base = p.trainer[0].gib
    assert p.host_offload_gib_per_node > 8 * base  # at least every GPU's frozen base shard
    assert any("host RAM per node" in x for x in p.problems)
    lay.host_mem_gib = 4000
    assert not any("host RAM" in x for x in planner.plan(cfg, lay).problems)


def test_shared_expert_adapter_count_does_not_depend_on_ep_but_its_copies_do():
    """Megatron-Bridge keeps one shared routed-expert adapter per MoE layer identical on every EP rank:
    the trained count is EP-free, the memory holds one copy per EP rank (sharded over expert DP)."""
    cfg = planner.load_public_config("kimi_k2")
    targets = ("linear_fc1", "linear_fc2")
    per_layer = planner.count_lora_params(cfg, 32, list(targets), "shared").routed_per_layer
    assert per_layer == 32 * (7168 + 2 * 2048) + 32 * (2048 + 7168)  # one fc1 + one fc2 adapter
    gib = {}
    for ep in (1, 8):
        lay = planner.Layout(n_gpus=64, gpu_mem_gib=80, tp=8, pp=8, ep=ep, etp=1, lora_rank=32, lora_targets=targets)
        p = planner.plan(cfg, lay)
        assert p.lora.routed_experts == len(planner.moe_layer_indices(cfg)) * per_layer
        gib[ep] = next(x.gib for x in p.trainer if x.name.startswith("LoRA params"))
    assert gib[1] == gib[8]  # replicated on every EP rank, not split


def test_refit_counts_lora_a_once_per_hf_projection_as_bridge_exports():
    """Megatron-Bridge's export writes a fused linear's LoRA-A once per HF projection (fc1 -> gate_proj
    and up_proj; linear_qkv -> q/k/v_proj) and splits B: per routed expert r*(3h+3I), not r*(2h+3I)."""
    k2 = planner.load_public_config("kimi_k2")
    h, inter, r = 7168, 2048, 32
    lo = planner.count_lora_params(k2, r, ["linear_fc1", "linear_fc2"], "shared")
    assert lo.exported_per_expert == r * (3 * h + 3 * inter)
    assert lo.routed_per_layer == r * (2 * h + 3 * inter)  # trained: one A for the fused fc1
    p = planner.plan(k2, _kimi_layout(lora_targets=("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                                                    "linear_proj", "linear_fc1", "linear_fc2")))
    assert p.refit_adapter_bytes == 2 * p.lora.exported
    assert 38.0 < p.refit_adapter_bytes / planner.GIB < 38.5  # the 28.4 GiB of r*(2h+3I) was 35 % low
    qwen = planner.load_public_config("qwen3_30b_a3b")
    q = planner.count_lora_params(qwen, 8, ["linear_qkv"], "shared")
    hq, out_qkv = qwen["hidden_size"], (qwen["num_attention_heads"] + 2 * qwen["num_key_value_heads"]) * qwen["head_dim"]
    assert q.exported == qwen["num_hidden_layers"] * 8 * (3 * hq + out_qkv) and q.attention == q.exported - \
        qwen["num_hidden_layers"] * 8 * 2 * hq


@pytest.mark.parametrize("exp,arm,readme", [
    ("01_kimi_k2_lora_grpo", None, "experiments/01_kimi_k2_lora_grpo/README.md"),
    ("03_qwen3_30b_a3b_lora_mitigations", "r3", "experiments/03_qwen3_30b_a3b_lora_mitigations/README.md"),
    ("04_moonlight_16b_a3b_r3", None, "experiments/04_moonlight_16b_a3b_r3/README.md"),
    ("01_kimi_k2_lora_grpo", None, "docs/benchmarks.md"),
])
def test_readme_refit_figures_are_the_planners(exp, arm, readme, capsys):
    """The refit figures the READMEs quote are what ``scripts/plan.py`` prints (at the README's precision)."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    plan = _script("plan")
    assert plan.main([f"experiments/{exp}"] + (["--arm", arm] if arm else [])) == 0
    out = capsys.readouterr().out
    adapter = float(re.search(r"adapter-only ([\d.]+) GiB", out).group(1))
    merged_text = re.search(r"merged\s+([\d.]+) (GiB|TiB) total", out)
    ratio = float(re.search(r"merged / adapter = ([\d.]+)x", out).group(1))
    text = " ".join((repo / readme).read_text().split())
    if readme.endswith("benchmarks.md"):
        m = re.search(r"refit per step ([\d.]+) GiB adapter vs ([\d.]+) (TiB|GiB) merged", text)
        quoted_adapter, quoted_merged, quoted_ratio = float(m.group(1)), float(m.group(2)), None
    else:
        m = re.search(r"adapter-only ([\d.]+) GiB.*?vs merged ([\d.]+) (?:TiB|GiB)(?: per step)? ?(?:\((\d+)×\))?", text)
        quoted_adapter, quoted_merged = float(m.group(1)), float(m.group(2))
        quoted_ratio = int(m.group(3)) if m.group(3) else None
    def same(got, quoted):  # equal at the quoted precision
        digits = len(str(quoted).split(".")[1]) if "." in str(quoted) else 0
        return round(got, digits) == quoted

    assert same(adapter, quoted_adapter), (readme, adapter, quoted_adapter)
    assert same(float(merged_text.group(1)), quoted_merged), (readme, merged_text.group(1), quoted_merged)
    if quoted_ratio is not None:
        assert round(ratio) == quoted_ratio


def test_refit_receive_side_holds_the_whole_exported_adapter_beside_vllms_weights():
    """Every step's refit peak on a rollout GPU: resumed vLLM weights + LoRA slot, every received adapter
    tensor (kept until the last bucket), the bucket and the stated allowance."""
    k2 = planner.load_public_config("kimi_k2")
    lay = _kimi_layout(rollout_ep=64, fully_sharded_loras=False, lora_targets=(
        "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_proj", "linear_fc1", "linear_fc2"))
    p = planner.plan(k2, lay)
    lines = {x.name: x.gib for x in p.refit_receive}
    received = lines["received adapter tensors, kept until the last bucket"]
    assert received == pytest.approx(p.refit_adapter_bytes / planner.GIB) and 38 < received < 39
    assert lines["transfer bucket (CUDA IPC)"] == 2.0
    assert p.refit_receive_gib == pytest.approx(sum(lines.values())) and 75 < p.refit_receive_gib < 77
    smaller = planner.plan(k2, _kimi_layout(**{**lay.__dict__, "refit_bucket_mib": 512}))
    assert p.refit_receive_gib - smaller.refit_receive_gib == pytest.approx(1.5)
    # an H100 with 64 GiB would not hold it: named as the refit's problem
    tight = planner.plan(k2, _kimi_layout(**{**lay.__dict__, "gpu_mem_gib": 64, "gpu_memory_utilization": 0.6}))
    assert any(x.startswith("refit (every step) needs") for x in tight.problems)
    # merged refit loads bucket by bucket: no accumulated adapter
    merged = planner.plan(k2, _kimi_layout(**{**lay.__dict__, "lora_merge": True}))
    assert not any("received adapter" in x.name for x in merged.refit_receive) and not merged.refit_base_sync


def test_host_ram_counts_vllms_level_1_sleep_copy_for_adapter_runs():
    k2 = planner.load_public_config("kimi_k2")
    lay = _kimi_layout(rollout_ep=64, fully_sharded_loras=False)
    adapter = planner.plan(k2, lay)
    merged = planner.plan(k2, _kimi_layout(**{**lay.__dict__, "lora_merge": True}))
    weights = sum(x.gib for x in adapter.rollout if x.name.startswith(("weights", "LoRA slot")))
    extra = adapter.host_offload_gib_per_node - merged.host_offload_gib_per_node
    assert extra == pytest.approx(8 * (weights + adapter.refit_adapter_bytes / planner.GIB))


def test_plan_prints_the_refit_receive_side(capsys):
    plan = _script("plan")
    assert plan.main(["experiments/01_kimi_k2_lora_grpo"]) == 0
    out = capsys.readouterr().out
    assert "refit receive side, every step:" in out and "update_weights_bucket_megabytes=512" in out
    assert "refit receive side, base sync (once):" in out
