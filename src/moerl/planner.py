"""Capacity planner for the scale experiments: parameters, per-GPU memory, refit and trace bytes.

Why it exists: one launch of experiment 01 costs thousands of GPU-hours, so whether a layout fits
must be known before the job is queued. Everything here is arithmetic on a model's *public*
config (``moerl/models/public_configs/*.json``, no hub download) and the parallel layout that the
launcher composes; no torch, no GPU.

Conventions (stated once, used everywhere):
- ``total`` counts every weight of the main model: input embedding, all decoder layers (attention,
  norms, dense MLPs, routed and shared experts, router weights and biases) and the output head.
  Multi-token-prediction (MTP) modules are reported separately (``mtp``) and are *not* in
  ``total``, as DeepSeek counts its 671B.
- ``active`` is ``total`` with the routed experts of each MoE layer replaced by ``top_k`` of them.
  The input embedding is included (it is a lookup, but published "activated" figures include it).
- Layers are numbered from 0 (the HF ``model.layers.{i}`` index, which is also RoutingTrace's
  ``moe_layers`` convention); Megatron's ``layer_number`` is this plus one.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

PUBLIC_CONFIG_DIR = Path(__file__).resolve().parent / "models" / "public_configs"
GIB = 1024**3
DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4, "fp8": 1}


class PlanError(ValueError):
    """A model config or layout the planner cannot use; the message names the key."""


# ---------------------------------------------------------------------------------------------
# model configs
# ---------------------------------------------------------------------------------------------

REQUIRED = {
    "deepseek_v3": ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_hidden_layers", "first_k_dense_replace", "num_attention_heads", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "tie_word_embeddings"),
    "qwen3_moe": ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                  "num_experts_per_tok", "tie_word_embeddings"),
}


def load_public_config(name_or_path: str | Path) -> dict:
    """A shipped public config by name (``kimi_k2``) or a JSON file path; checks required keys."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PUBLIC_CONFIG_DIR / f"{name_or_path}.json"
    if not path.exists():
        have = sorted(p.stem for p in PUBLIC_CONFIG_DIR.glob("*.json"))
        raise PlanError(f"model config '{name_or_path}' not found (looked for {path}; shipped: {have})")
    cfg = json.loads(path.read_text())
    family = cfg.get("family")
    if family not in REQUIRED:
        raise PlanError(f"{path}: 'family' must be one of {sorted(REQUIRED)}, got {family!r}")
    missing = [k for k in REQUIRED[family] if k not in cfg]
    if missing:
        raise PlanError(f"{path}: missing keys {missing} for family {family}")
    cfg["_path"] = str(path)
    return cfg


def num_experts(cfg: dict) -> int:
    return cfg["n_routed_experts"] if cfg["family"] == "deepseek_v3" else cfg["num_experts"]


def moe_layer_indices(cfg: dict) -> list[int]:
    """Global (0-based) numbers of the MoE layers. DeepSeek-V3-style models start with
    ``first_k_dense_replace`` dense layers, so MoE layer *j* is decoder layer ``j + k``: mapping
    replay data by position instead of by this number is the bug that broke R3 on Moonlight."""
    n = cfg["num_hidden_layers"]
    if cfg["family"] == "deepseek_v3":
        k, freq = cfg["first_k_dense_replace"], cfg.get("moe_layer_freq", 1)
        return [i for i in range(n) if i >= k and i % freq == 0]
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers", []))
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def megatron_moe_layer_freq(cfg: dict) -> list[int]:
    """The per-layer 0/1 pattern Megatron-Core's ``moe_layer_freq`` must hold for this model."""
    moe = set(moe_layer_indices(cfg))
    return [int(i in moe) for i in range(cfg["num_hidden_layers"])]


# ---------------------------------------------------------------------------------------------
# linear layers: (name, in_features, out_features) per decoder layer, in Megatron names
# ---------------------------------------------------------------------------------------------

def attention_linears(cfg: dict) -> list[tuple[str, int, int]]:
    """Attention projections with Megatron-Core module names (what LoRA target_modules match)."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg["family"] == "deepseek_v3":  # MLA
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        out = []
        if cfg["q_lora_rank"]:
            out += [("linear_q_down_proj", h, cfg["q_lora_rank"]),
                    ("linear_q_up_proj", cfg["q_lora_rank"], nh * qk)]
        else:
            out += [("linear_q_proj", h, nh * qk)]
        out += [("linear_kv_down_proj", h, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]),
                ("linear_kv_up_proj", cfg["kv_lora_rank"],
                 nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])),
                ("linear_proj", nh * cfg["v_head_dim"], h)]
        return out
    hd, nkv = cfg["head_dim"], cfg["num_key_value_heads"]
    return [("linear_qkv", h, (nh + 2 * nkv) * hd), ("linear_proj", nh * hd, h)]


def attention_norm_params(cfg: dict) -> int:
    """Norm weights inside attention (MLA latent norms / Qwen3 per-head q,k norms)."""
    if cfg["family"] == "deepseek_v3":
        return (cfg["q_lora_rank"] or 0) + cfg["kv_lora_rank"]
    return 2 * cfg["head_dim"]


def mlp_linears(hidden: int, inter: int) -> list[tuple[str, int, int]]:
    """SwiGLU MLP in Megatron layout: fc1 is the fused gate+up projection."""
    return [("linear_fc1", hidden, 2 * inter), ("linear_fc2", inter, hidden)]


def _params(linears) -> int:
    return sum(i * o for _, i, o in linears)


@dataclass
class ParamCounts:
    total: int
    active: int
    embedding: int
    lm_head: int
    attention: int
    dense_mlp: int
    routed_experts: int
    shared_experts: int
    router: int
    norms: int
    mtp: int
    per_expert: int
    num_moe_layers: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def count_params(cfg: dict) -> ParamCounts:
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    moe = moe_layer_indices(cfg)
    e, k = num_experts(cfg), cfg["num_experts_per_tok"]
    attn = n * (_params(attention_linears(cfg)) + attention_norm_params(cfg))
    norms = n * 2 * h + h  # input + post-attention norm per layer, final norm
    per_expert = _params(mlp_linears(h, cfg["moe_intermediate_size"]))
    n_dense = n - len(moe)
    dense = n_dense * _params(mlp_linears(h, cfg.get("intermediate_size", 0))) if n_dense else 0
    routed = len(moe) * e * per_expert
    shared = len(moe) * cfg.get("n_shared_experts", 0) * per_expert
    # router weight [E, H]; DeepSeek-V3 adds the e_score_correction_bias [E]
    router = len(moe) * (e * h + (e if cfg["family"] == "deepseek_v3" else 0))
    emb = v * h
    head = 0 if cfg["tie_word_embeddings"] else v * h
    total = emb + head + attn + norms + dense + routed + shared + router
    active = total - routed + len(moe) * k * per_expert
    mtp = 0
    if cfg.get("num_nextn_predict_layers", 0):
        # one full MoE decoder layer + eh_proj [H, 2H] + enorm/hnorm, sharing embedding and head
        one_layer = (_params(attention_linears(cfg)) + attention_norm_params(cfg) + 2 * h
                     + (e + cfg.get("n_shared_experts", 0)) * per_expert + e * h + e)
        mtp = cfg["num_nextn_predict_layers"] * (one_layer + 2 * h * h + 3 * h)
    return ParamCounts(total=total, active=active, embedding=emb, lm_head=head, attention=attn,
                       dense_mlp=dense, routed_experts=routed, shared_experts=shared, router=router,
                       norms=norms, mtp=mtp, per_expert=per_expert, num_moe_layers=len(moe))


# ---------------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------------

EXPERT_ADAPTER_MODES = ("shared", "per_expert")


def lora_target_names(cfg: dict) -> set[str]:
    """Every Megatron module name a LoRA target can match in this model."""
    return {name for name, _, _ in attention_linears(cfg)} | {"linear_fc1", "linear_fc2"}


@dataclass
class LoraCounts:
    total: int
    attention: int
    dense_mlp: int
    shared_experts: int
    routed_experts: int
    routed_per_layer: int
    unmatched_targets: list[str] = field(default_factory=list)
    exported: int = 0              # elements Megatron-Bridge's HF export writes (routed: per expert)
    exported_per_expert: int = 0   # of which one routed expert's adapter (every expert name gets one)


# How many Hugging Face projections Megatron-Bridge's adapter export writes for one fused Megatron
# linear. Each gets the *same* LoRA-A (linear_in) and its own slice of LoRA-B, so a fused linear's A
# travels once per projection: Megatron-Bridge 0.6.x models/conversion/peft_bridge.py
# stream_adapter_weights_megatron_to_hf yields (linear_in_hf_names[index], linear_in) for every base
# name of a fused adapter (~1014 in 0.6.2; r0.6.0 branch line 1013). fc1 -> gate_proj, up_proj;
# linear_qkv -> q_proj, k_proj, v_proj. Per routed expert: r*(3h+3I), not the r*(2h+3I) trained.
BRIDGE_EXPORT_PROJECTIONS = {"linear_fc1": 2, "linear_qkv": 3}


def exported_lora_elems(linears, rank: int, targets) -> int:
    """LoRA elements of these linears as Megatron-Bridge exports them to HF names (A repeated per
    projection of a fused linear, B split)."""
    return sum(rank * (i * BRIDGE_EXPORT_PROJECTIONS.get(name, 1) + o) for name, i, o in linears if name in targets)


def count_lora_params(cfg: dict, rank: int, targets: list[str], expert_mode: str = "shared",
                      normalize_moe_lora: bool = False) -> LoraCounts:
    """LoRA parameters r*(in+out) per targeted linear, as Megatron-Bridge places them.

    ``linear_fc1``/``linear_fc2`` match the dense MLPs, the shared experts and the routed experts
    (Bridge regex ``.*experts.*linear_fc[12]``). Routed experts get one adapter per layer shared
    by all of that layer's experts (``share_expert_adapters=True``, the Bridge default) or one per
    expert (``per_expert``); ``normalize_moe_lora`` divides the expert rank by top-k.

    These are *trained* parameters. Under EP, Megatron-Bridge (0.6.x; peft/utils.py
    ParallelLinearAdapter) stores the shared adapter once on every EP rank and keeps the copies
    identical (broadcast from EP rank 0 when built, gradients summed over EP; with
    gradient-accumulation fusion off, see the launcher rule bridge.shared_expert_adapter_under_ep),
    so the count does not depend on EP; the memory plan counts the copies (``plan``: replicated on
    each EP rank)."""
    if expert_mode not in EXPERT_ADAPTER_MODES:
        raise PlanError(f"expert adapter mode must be one of {EXPERT_ADAPTER_MODES}, got {expert_mode!r}")
    names = lora_target_names(cfg)
    unmatched = [t for t in targets if t not in names]

    def lora(linears, r=rank):
        return sum(r * (i + o) for name, i, o in linears if name in targets)

    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    moe = moe_layer_indices(cfg)
    attn = n * lora(attention_linears(cfg))
    n_dense = n - len(moe)
    dense = n_dense * lora(mlp_linears(h, cfg.get("intermediate_size", 0))) if n_dense else 0
    expert_lin = mlp_linears(h, cfg["moe_intermediate_size"])
    shared = len(moe) * cfg.get("n_shared_experts", 0) * lora(expert_lin)
    r_exp = max(1, rank // cfg["num_experts_per_tok"]) if normalize_moe_lora else rank
    per_layer = lora(expert_lin, r_exp) * (num_experts(cfg) if expert_mode == "per_expert" else 1)
    routed = len(moe) * per_layer
    dense_lin = mlp_linears(h, cfg.get("intermediate_size", 0))
    per_expert_export = exported_lora_elems(expert_lin, r_exp, targets)
    exported = (n * exported_lora_elems(attention_linears(cfg), rank, targets)
                + (n_dense * exported_lora_elems(dense_lin, rank, targets) if n_dense else 0)
                + len(moe) * cfg.get("n_shared_experts", 0) * exported_lora_elems(expert_lin, rank, targets)
                + len(moe) * num_experts(cfg) * per_expert_export)
    return LoraCounts(total=attn + dense + shared + routed, attention=attn, dense_mlp=dense,
                      shared_experts=shared, routed_experts=routed, routed_per_layer=per_layer,
                      unmatched_targets=unmatched, exported=exported, exported_per_expert=per_expert_export)


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------

# The refit's contexts and buffers on one GPU: two CUDA contexts (the trainer worker's and the vLLM
# worker's, ~0.5-1 GiB each), their NCCL communicators (TP/PP/EP/DP groups of the trainer, TP/EP of vLLM)
# and allocator fragmentation. An assumption, not a measurement: no GPU run has been made.
REFIT_CONTEXT_ALLOWANCE_GIB = 5.0

@dataclass
class Layout:
    """The trainer (Megatron) and rollout (vLLM) layouts of one experiment, as composed."""

    n_gpus: int
    gpu_mem_gib: float
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    rollout_tp: int = 1
    rollout_ep: int = 1
    rollout_dp: int = 1
    gpu_memory_utilization: float = 0.5
    param_offload: bool = False
    optimizer_offload: bool = False
    recompute_full: bool = False
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    expert_mode: str = "shared"
    lora_merge: bool = False
    fully_sharded_loras: bool = False
    prompt_len: int = 1024
    response_len: int = 2048
    micro_batch_tokens: int = 8192
    train_batch_size: int = 128
    rollout_n: int = 8
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    gpus_per_node: int = 8
    host_mem_gib: float | None = None  # per node; None = not checked
    refit_bucket_mib: int = 2048        # verl rollout.checkpoint_engine.update_weights_bucket_megabytes (rollout.yaml:296)

    @property
    def dp(self) -> int:
        return self.n_gpus // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.n_gpus // (self.etp * self.ep * self.pp)


def kv_bytes_per_token(cfg: dict, dtype_bytes: int, tp: int) -> float:
    """KV cache bytes per token per TP rank. MLA caches the compressed latent plus the rope key
    (kv_lora_rank + qk_rope_head_dim per layer), replicated on every TP rank in vLLM; GQA caches
    K and V of its KV heads, split over TP (replicated when TP exceeds the KV head count)."""
    n = cfg["num_hidden_layers"]
    if cfg["family"] == "deepseek_v3":
        return n * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * dtype_bytes
    kv_heads_per_rank = max(1, cfg["num_key_value_heads"] // tp)
    return n * 2 * kv_heads_per_rank * cfg["head_dim"] * dtype_bytes


@dataclass
class MemoryLine:
    name: str
    gib: float
    note: str = ""


@dataclass
class Plan:
    model: str
    params: ParamCounts
    lora: LoraCounts | None
    trainer: list[MemoryLine]
    rollout: list[MemoryLine]
    gpu_mem_gib: float
    refit_adapter_bytes: int
    refit_merged_bytes: int
    refit_merged_per_rollout_rank_bytes: int
    trace_tokens_per_step: int
    trace_packed_bytes: int
    trace_int16_bytes: int
    trace_bits_per_token: int
    rollout_kv_tokens: float
    trainer_resident_during_rollout_gib: float = 0.0
    host_offload_gib_per_node: float = 0.0
    problems: list[str] = field(default_factory=list)
    refit_receive: list[MemoryLine] = field(default_factory=list)    # per rollout GPU, the step's refit peak
    refit_base_sync: list[MemoryLine] = field(default_factory=list)  # the one-off base sync of a LoRA run

    @property
    def refit_receive_gib(self) -> float:
        return sum(x.gib for x in self.refit_receive)

    @property
    def refit_base_sync_gib(self) -> float:
        return sum(x.gib for x in self.refit_base_sync)

    @property
    def trainer_gib(self) -> float:
        return sum(x.gib for x in self.trainer)

    @property
    def rollout_gib(self) -> float:
        return sum(x.gib for x in self.rollout)


VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks


def vllm_max_lora_rank(rank: int) -> int:
    """The max_lora_rank verl passes to vLLM: the rank rounded up to an allowed value
    (verl/workers/rollout/vllm_rollout/utils.py::get_vllm_max_lora_rank)."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise PlanError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_MAX_LORA_RANKS[-1]}")


def vllm_moe_lora_elems_per_rank(cfg: dict, slot_rank: int, tp: int, ep: int, fully_sharded: bool) -> float:
    """Elements of one MoE layer's LoRA slot on one vLLM rank, by vLLM 0.24's tensor shapes
    (vllm/lora/layers/fused_moe.py ``_create_lora_a_weights`` / ``_create_lora_b_weights``,
    max_loras=1): gate and up keep *separate* A [r, H] and B [I_p, r]; down has A [r, I_p] and
    B [H, r]. With EP the MoE TP size collapses to 1 (I_p = I) and each rank holds its E/EP local
    experts; without EP every rank holds all E experts with I_p = I/TP. fully_sharded_loras splits
    gate/up A's rank and down B's H over TP."""
    h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], num_experts(cfg)
    moe_tp = 1 if ep > 1 else tp
    local = e // ep if ep > 1 else e
    i_p = i / moe_tp
    shard = moe_tp if fully_sharded else 1
    a13 = 2 * (slot_rank / shard) * h
    b13 = 2 * i_p * slot_rank
    a2 = slot_rank * i_p
    b2 = (h / shard) * slot_rank
    return local * (a13 + b13 + a2 + b2)


def routing_trace_bits_per_token(cfg: dict) -> int:
    """L_moe * k * ceil(log2 E) bits: the information in one token's routing decision."""
    return len(moe_layer_indices(cfg)) * cfg["num_experts_per_tok"] * math.ceil(math.log2(num_experts(cfg)))


def plan(cfg: dict, layout: Layout) -> Plan:
    """Per-GPU memory of trainer and rollout, refit and trace bytes; ``problems`` lists what does
    not fit (empty when the layout fits)."""
    pc = count_params(cfg)
    wb = DTYPE_BYTES[layout.weight_dtype]
    tp, pp, ep, etp = layout.tp, layout.pp, layout.ep, layout.etp
    # Megatron: dense weights split over TP*PP; expert weights over EP*ETP*PP. Embedding and head
    # live on the first/last stage only, split over TP: the worst stage holds one of them.
    expert_w = pc.routed_experts + pc.shared_experts
    dense_w = pc.total - expert_w - pc.embedding - pc.lm_head
    per_gpu = dense_w / (tp * pp) + pc.routed_experts / (ep * etp * pp) + pc.shared_experts / (tp * pp)
    per_gpu += max(pc.embedding, pc.lm_head) / tp
    base_gib = per_gpu * wb / GIB
    # Peak is during the update, when verl has loaded everything back; offload only frees the GPU
    # for the colocated rollout (checked below).
    trainer = [MemoryLine("base weights (bf16, frozen)", base_gib)]
    lora = None
    if layout.lora_rank > 0:
        lora = count_lora_params(cfg, layout.lora_rank, list(layout.lora_targets), layout.expert_mode)
        # adapters shard like their base linears; expert adapters follow EP (per-expert) or are
        # replicated on every EP rank (shared), dense ones follow TP
        routed_l = lora.routed_experts / (ep * pp) if layout.expert_mode == "per_expert" else lora.routed_experts / pp
        lora_per_gpu = (lora.total - lora.routed_experts) / (tp * pp) + routed_l
        trainer.append(MemoryLine("LoRA params (bf16)", lora_per_gpu * wb / GIB))
        # fp32 main grads + Adam fp32 master, m, v: 4 + 12 bytes, distributed optimizer over DP
        trainer.append(MemoryLine("LoRA grads (fp32)", lora_per_gpu * 4 / GIB))
        # expert parameters (routed-expert adapters, shared or not) are sharded by the distributed
        # optimizer over the expert-data-parallel group, the rest over DP (megatron-core
        # optimizer/__init__.py: expert param groups use intra_expt_dp_group)
        optim = ((lora_per_gpu - routed_l) * 12 / max(1, layout.dp) + routed_l * 12 / max(1, layout.edp)) / GIB
        trainer.append(MemoryLine("optimizer states (fp32 master+Adam, sharded over DP)", optim))
    else:
        full = per_gpu
        trainer.append(MemoryLine("grads (fp32)", full * 4 / GIB))
        trainer.append(MemoryLine("optimizer states (fp32 master+Adam, sharded over DP)",
                                  full * 12 / max(1, layout.dp) / GIB))
    # Activations: per micro-batch token, per layer on this stage. Full recompute keeps only the
    # layer inputs (2*H bytes bf16 per token per layer, split over TP*CP with sequence parallel)
    # plus one layer's working set; without recompute ~34*H bytes per token per layer (Korthikanti
    # et al. 2022, selective recompute, SP on) and the MoE dispatch buffers k*H*2 bytes.
    h = cfg["hidden_size"]
    tokens = layout.micro_batch_tokens / layout.cp
    layers_here = math.ceil(cfg["num_hidden_layers"] / pp)
    k = cfg["num_experts_per_tok"]
    if layout.recompute_full:
        act = tokens * layers_here * 2 * h / tp + tokens * (34 * h / tp + 4 * k * h)
    else:
        act = tokens * layers_here * (34 * h / tp + 4 * k * h)
    # logits for the micro-batch (fp32, vocab split over TP) are the other large term
    act += tokens * cfg["vocab_size"] * 4 / tp
    trainer.append(MemoryLine("activations (estimate)", act / GIB,
                              f"{int(tokens)} tokens/micro-batch, {layers_here} layers/stage"))
    trainer.append(MemoryLine("CUDA context + NCCL + fragmentation", 4.0, "fixed allowance"))

    # rollout: vLLM. Without EP every weight is split over TP; with EP (vLLM: EP = TP*DP) the routed
    # experts are split over the EP ranks and the rest over TP.
    rtp, rep = layout.rollout_tp, layout.rollout_ep
    if rep > 1:
        w_roll = (pc.total - pc.routed_experts) * wb / rtp + pc.routed_experts * wb / rep
    else:
        w_roll = pc.total * wb / rtp
    rollout = [MemoryLine("weights per rank (bf16)", w_roll / GIB)]
    adapter_elems = 0
    if lora is not None and not layout.lora_merge:
        # The refit payload is what Megatron-Bridge's export writes: a shared expert adapter
        # replicated under every expert name (vLLM loads expert adapters per expert), and a fused
        # linear's LoRA-A once per HF projection (BRIDGE_EXPORT_PROJECTIONS).
        n_moe = len(moe_layer_indices(cfg))
        adapter_elems = lora.exported
        routed_export = n_moe * num_experts(cfg) * lora.exported_per_expert
        # vLLM sizes the slot at max_lora_rank (rank rounded up to an allowed value), max_loras=1 (verl).
        # (a rank above vLLM's maximum is reported by the constraint layer's vllm.max_lora_rank rule)
        slot_rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= layout.lora_rank), layout.lora_rank)
        expert_slot = n_moe * vllm_moe_lora_elems_per_rank(cfg, slot_rank, rtp, rep, layout.fully_sharded_loras)
        # attention/dense/shared-expert adapters: with fully_sharded_loras everything is split over TP;
        # without, about half of each A/B pair is replicated on every TP rank
        other_elems = (adapter_elems - routed_export) * slot_rank / layout.lora_rank
        other = other_elems / rtp if layout.fully_sharded_loras else other_elems * (0.5 + 0.5 / rtp)
        rollout.append(MemoryLine("LoRA slot, routed experts (vLLM fused-MoE shapes, bf16)", expert_slot * wb / GIB,
                                  f"max_lora_rank={slot_rank}, {num_experts(cfg) // max(rep, 1)} local experts"))
        rollout.append(MemoryLine("LoRA slot, attention/dense/shared (bf16)", other * wb / GIB))
    budget = layout.gpu_mem_gib * layout.gpu_memory_utilization
    # Colocated (hybrid engine): what the trainer keeps on the GPU while vLLM runs.
    params_grads = sum(x.gib for x in trainer[:3] if not x.name.startswith("optimizer"))
    optim_gib = sum(x.gib for x in trainer if x.name.startswith("optimizer"))
    resident = (0.0 if layout.param_offload else params_grads) + (0.0 if layout.optimizer_offload else optim_gib)
    # what offload puts in host RAM, per node (every GPU of the node offloads its own shard)
    host = ((params_grads if layout.param_offload else 0.0) + (optim_gib if layout.optimizer_offload else 0.0)
            ) * layout.gpus_per_node
    host_vllm = 0.0
    if lora is not None and not layout.lora_merge:
        # An adapter run puts vLLM to sleep at level 1 (verl vllm_async_server.py:1289-1305), which copies
        # every rank's weights and LoRA slot to host memory rather than dropping them; the received adapter
        # is also held as a CPU LoRA model by vLLM's LoRA manager (the last audit's count, not read in
        # vLLM's source here).
        host_vllm = (sum(x.gib for x in rollout if x.name.startswith(("weights", "LoRA slot")))
                     + adapter_elems * wb / GIB) * layout.gpus_per_node
    host += host_vllm
    rollout.append(MemoryLine("activation/graph workspace (allowance)", 2.0))
    kv_gib = budget - sum(x.gib for x in rollout)
    rollout.append(MemoryLine("KV cache (what is left of gpu_memory_utilization)", max(kv_gib, 0.0),
                              f"gpu_memory_utilization={layout.gpu_memory_utilization}"))
    kvb = kv_bytes_per_token(cfg, DTYPE_BYTES[layout.kv_dtype], rtp)
    kv_tokens = max(kv_gib, 0.0) * GIB / kvb

    # refit: adapter-only sends the exported adapter tensors (vLLM per-expert layout); merged sends
    # the whole model in bf16
    adapter_bytes = adapter_elems * wb
    merged_bytes = pc.total * wb
    # trace bytes per step: every token of every sample (prompt + response), all MoE layers
    tokens_step = layout.train_batch_size * layout.rollout_n * (layout.prompt_len + layout.response_len)
    bits = routing_trace_bits_per_token(cfg)
    packed = math.ceil(tokens_step * bits / 8)
    int16 = tokens_step * len(moe_layer_indices(cfg)) * k * 2

    # The refit, on each rollout GPU (verl 0.9.1 colocated "naive" sync, workers/engine_workers.py:768-815):
    # vLLM's weights are resumed (KV cache still freed), the trainer loads its parameters back to the GPU
    # (engine/megatron/transformer_impl.py:1036-1040: the adapters only, once the base is synced) and
    # streams them through one CUDA bucket it shares with vLLM by IPC (rollout/vllm_rollout/
    # bucketed_weight_transfer.py:179-183). Adapter tensors are cloned and kept until the last bucket
    # (vllm_rollout/utils.py:300-318), and Bridge exports the shared expert adapter under every expert's
    # name: the whole exported adapter sits on every rollout GPU at once.
    roll_weights = sum(x.gib for x in rollout if not x.name.startswith(("activation", "KV")))
    lora_gib = next((x.gib for x in trainer if x.name.startswith("LoRA params")), 0.0)
    optim_on_gpu = 0.0 if layout.optimizer_offload else optim_gib
    bucket = layout.refit_bucket_mib / 1024
    ctx = MemoryLine("CUDA contexts + NCCL + fragmentation (allowance)", REFIT_CONTEXT_ALLOWANCE_GIB,
                     "assumed, not measured")
    full_trainer = MemoryLine("trainer weights loaded back (base + adapters)", base_gib + lora_gib,
                              "load_frozen_params=True")
    receive, base_sync = [], []
    if lora is not None and not layout.lora_merge:
        receive = [MemoryLine("vLLM weights + LoRA slot (resumed)", roll_weights),
                   MemoryLine("trainer adapters loaded back" if layout.param_offload else
                              "trainer weights + grads (not offloaded)",
                              lora_gib if layout.param_offload else params_grads),
                   MemoryLine("received adapter tensors, kept until the last bucket", adapter_elems * wb / GIB,
                              "every exported tensor, shared expert adapter under all expert names"),
                   MemoryLine("transfer bucket (CUDA IPC)", bucket, f"update_weights_bucket_megabytes="
                                                                    f"{layout.refit_bucket_mib}"), ctx]
        base_sync = [MemoryLine("vLLM weights + LoRA slot (resumed)", roll_weights), full_trainer,
                     MemoryLine("transfer bucket (CUDA IPC)", bucket), ctx]
    else:  # merged or full weights every step: applied bucket by bucket, nothing accumulates
        receive = [MemoryLine("vLLM weights (resumed)", roll_weights), full_trainer,
                   MemoryLine("transfer bucket (CUDA IPC)", bucket), ctx]
    if optim_on_gpu:
        for lines in (receive, base_sync):
            if lines:
                lines.insert(2, MemoryLine("optimizer states (not offloaded)", optim_on_gpu))

    problems = []
    for what, lines in (("refit (every step)", receive), ("refit base sync (once)", base_sync)):
        need = sum(x.gib for x in lines)
        if lines and need > layout.gpu_mem_gib:
            problems.append(f"{what} needs {need:.1f} GiB on each rollout GPU ({', '.join(f'{x.name} {x.gib:.1f}' for x in lines)}) "
                            f"but the GPU has {layout.gpu_mem_gib:.0f} GiB (over by {need - layout.gpu_mem_gib:.1f} GiB)")
    if resident + budget > layout.gpu_mem_gib:
        problems.append(f"colocated rollout: trainer keeps {resident:.1f} GiB resident (param_offload="
                        f"{layout.param_offload}, optimizer_offload={layout.optimizer_offload}) plus vLLM's "
                        f"{budget:.1f} GiB exceeds {layout.gpu_mem_gib:.0f} GiB "
                        f"(over by {resident + budget - layout.gpu_mem_gib:.1f} GiB)")
    if layout.host_mem_gib is not None and host > layout.host_mem_gib:
        problems.append(f"offloaded params/grads/optimizer and vLLM's sleep copy need {host:.0f} GiB host RAM per "
                        f"node, the node has "
                        f"{layout.host_mem_gib:.0f} GiB (over by {host - layout.host_mem_gib:.0f} GiB)")
    trainer_total = sum(x.gib for x in trainer)
    if trainer_total > layout.gpu_mem_gib:
        problems.append(f"trainer needs {trainer_total:.1f} GiB per GPU but the GPU has {layout.gpu_mem_gib:.0f} GiB "
                        f"(over by {trainer_total - layout.gpu_mem_gib:.1f} GiB)")
    if kv_gib <= 0:
        problems.append(f"rollout weights need {sum(x.gib for x in rollout[:-1]):.1f} GiB per GPU but "
                        f"gpu_memory_utilization*{layout.gpu_mem_gib:.0f} GiB = {budget:.1f} GiB "
                        f"(over by {-kv_gib:.1f} GiB; no room for a KV cache)")
    else:
        seq = layout.prompt_len + layout.response_len
        if kv_tokens < seq:
            problems.append(f"rollout KV cache holds {kv_tokens:.0f} tokens per replica, less than one "
                            f"sequence of {seq} tokens")
    return Plan(model=cfg.get("name", "?"), params=pc, lora=lora, trainer=trainer, rollout=rollout,
                gpu_mem_gib=layout.gpu_mem_gib, refit_adapter_bytes=adapter_bytes,
                refit_merged_bytes=merged_bytes, refit_merged_per_rollout_rank_bytes=merged_bytes // rtp,
                trace_tokens_per_step=tokens_step, trace_packed_bytes=packed, trace_int16_bytes=int16,
                trace_bits_per_token=bits, rollout_kv_tokens=kv_tokens,
                trainer_resident_during_rollout_gib=resident, host_offload_gib_per_node=host,
                problems=problems, refit_receive=receive, refit_base_sync=base_sync)


# ---------------------------------------------------------------------------------------------
# One device: a checkpoint's trainer and embedded rollout engine side by side (experiment 08)
# ---------------------------------------------------------------------------------------------

# CUDA context, cuBLAS workspaces and the caching allocator's fragmentation: a stated allowance, not a measurement.
DEVICE_ALLOWANCE_GIB = 2.0
# Bytes per trained LoRA element: fp32 weight, fp32 gradient, AdamW's two fp32 moments.
LORA_BYTES_PER_PARAM = 16


@dataclass
class ModelShape:
    """What the one-device plan needs of a model, counted exactly on its class (moerl.models.pretrained)."""

    params: int
    lora_params: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    kv_values_per_token: int  # key and value elements one token adds to the engine's cache, all layers


@dataclass
class OneDevicePlan:
    device: str
    device_gib: float
    lines: list[MemoryLine]

    @property
    def total_gib(self) -> float:
        return sum(line.gib for line in self.lines)

    @property
    def margin_gib(self) -> float:
        return self.device_gib - self.total_gib


def plan_one_device(shape: ModelShape, *, trainer_dtype: str, rollout_sequences: int, sequence_tokens: int,
                    micro_batch: int, activation_checkpointing: bool, device_gib: float,
                    device_name: str) -> OneDevicePlan:
    """Memory of one GRPO step on one device: the trainer's weights, the LoRA with its gradients and AdamW
    state, the engine's own bf16 copy (quantised rollouts are stored rounded, in bf16) and its KV cache for
    every sequence of a step, and the scoring pass's largest tensors (fp32 logits, their log-softmax and the
    entropy's exp over the vocabulary; the decoder activations, at layer boundaries under checkpointing)."""
    b = DTYPE_BYTES[trainer_dtype]
    act_tokens = micro_batch * sequence_tokens
    layer_acts = (1 if activation_checkpointing else 16) * shape.num_layers * act_tokens * shape.hidden_size * b
    lines = [
        MemoryLine("trainer weights", shape.params * b / GIB, f"{shape.params / 1e9:.2f}B params in {trainer_dtype}"),
        MemoryLine("LoRA + grads + AdamW", shape.lora_params * LORA_BYTES_PER_PARAM / GIB,
                   f"{shape.lora_params / 1e6:.1f}M params x {LORA_BYTES_PER_PARAM} B"),
        MemoryLine("engine weights (bf16 copy)", shape.params * 2 / GIB, "the rollout engine's own copy"),
        MemoryLine("engine KV cache", rollout_sequences * sequence_tokens * shape.kv_values_per_token * 2 / GIB,
                   f"{rollout_sequences} sequences x {sequence_tokens} tokens"),
        MemoryLine("scoring logits (fp32 x 3)", 3 * act_tokens * shape.vocab_size * 4 / GIB,
                   f"micro-batch {micro_batch} x {sequence_tokens} tokens x vocab {shape.vocab_size}"),
        MemoryLine("decoder activations", layer_acts / GIB,
                   "layer boundaries (checkpointing)" if activation_checkpointing else "about 16 per layer, no checkpointing"),
        MemoryLine("allowance", DEVICE_ALLOWANCE_GIB, "CUDA context, workspaces, fragmentation (stated, not measured)"),
    ]
    return OneDevicePlan(device_name, device_gib, lines)


def one_device_report(plan: OneDevicePlan) -> str:
    total, margin = plan.total_gib, plan.margin_gib
    width = max(len(line.name) for line in plan.lines)
    rows = [f"  {line.name:<{width}}  {line.gib:8.2f} GiB  {line.note}" for line in plan.lines]
    verdict = (f"fits: {total:.1f} of {plan.device_gib:.1f} GiB, {margin:.1f} GiB to spare" if margin >= 0 else
               f"does NOT fit: {total:.1f} GiB needed, {plan.device_gib:.1f} GiB on the device, {-margin:.1f} GiB short")
    return "\n".join([f"memory plan on {plan.device}:", *rows, f"  {verdict}"])
