"""Split and join base and LoRA weights under TP, EP, ETP and PP (pure tensor math, torch only).

Rules (Megatron-Core / Megatron-Bridge conventions, weights as ``[out, in]``):
- column-parallel (q/k/v, gate/up, fc1): the base and LoRA B split on ``out``; LoRA A replicated.
  Outputs are concatenated. Fused tensors (gate|up, q|k|v) split *each segment*, and rank r holds
  the concatenation of its pieces, so a rank's slice still reads "its gate, then its up".
- row-parallel (o_proj, down, fc2): the base and LoRA A split on ``in``; LoRA B replicated.
  Partial outputs are summed (all-reduce): ``B (sum_r A_r x_r) = sum_r B A_r x_r``.
- EP: fused expert tensors ``[E, ...]`` split on the expert dim into contiguous blocks; rank r owns
  global experts ``[r*E/ep, (r+1)*E/ep)``. A shared LoRA factor (expert dim 1) is replicated.
- ETP: inside each expert, gate_up is column-parallel (fused) and down row-parallel, over the ETP group.
- PP: stage s owns a contiguous block of decoder layers and their adapters; refit gathers all stages.

Kept free of transformers imports so torch.distributed workers start fast.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch


class ShardingError(ValueError):
    """A tensor that cannot be split/joined as asked; names tensor, dim and sizes."""


# ---- 1-D primitives --------------------------------------------------------------------------


def split_dim(t: torch.Tensor, parts: int, dim: int, name: str = "tensor") -> list[torch.Tensor]:
    if t.shape[dim] % parts:
        raise ShardingError(f"{name}: dim {dim} of size {t.shape[dim]} does not split into {parts} shards")
    return [c.contiguous() for c in torch.chunk(t, parts, dim=dim)]


def split_fused(t: torch.Tensor, sizes: Sequence[int], parts: int, dim: int,
                name: str = "tensor") -> list[torch.Tensor]:
    """Split each fused segment (e.g. gate|up, q|k|v) ``parts`` ways; rank r = cat of its pieces."""
    if sum(sizes) != t.shape[dim]:
        raise ShardingError(f"{name}: fused segments {list(sizes)} do not add up to dim {dim} = {t.shape[dim]}")
    segments = torch.split(t, list(sizes), dim=dim)
    pieces = [split_dim(s, parts, dim, f"{name} segment {i}") for i, s in enumerate(segments)]
    return [torch.cat([p[r] for p in pieces], dim=dim) for r in range(parts)]


def join_fused(shards: Sequence[torch.Tensor], sizes: Sequence[int], dim: int) -> torch.Tensor:
    parts = len(shards)
    local = [s // parts for s in sizes]
    per_rank = [torch.split(sh, local, dim=dim) for sh in shards]
    return torch.cat([torch.cat([per_rank[r][i] for r in range(parts)], dim=dim) for i in range(len(sizes))],
                     dim=dim)


# ---- how one tensor is sharded ---------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A parallel layout. ``tp`` shards dense layers, ``ep`` splits experts, ``etp`` shards inside an
    expert, ``pp`` splits decoder layers into stages. Ranks of one stage: ``(ep_rank, tp_rank)``
    for expert tensors (tp_rank over etp), ``(0, tp_rank)`` for dense ones."""

    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1


@dataclass(frozen=True)
class ShardSpec:
    """How a tensor splits. ``tp_dim`` None = replicated over TP/ETP; ``fused`` = segment sizes along
    tp_dim; ``expert_dim`` set for fused expert tensors (split over EP);
    ``group`` says whether tp_dim splits over ``tp`` or ``etp``; ``shared`` marks a [1, ...] LoRA factor
    shared by all experts (spec_for reads it from the shape)."""

    tp_dim: int | None = None
    fused: tuple[int, ...] | None = None
    expert_dim: int | None = None
    group: str = "tp"
    shared: bool = False  # an expert-LoRA factor shared by all experts ([1, ...]): replicated over EP

    def tp_size(self, layout: Layout) -> int:
        return layout.etp if self.group == "etp" else layout.tp


REPLICATED = ShardSpec()


def shard(t: torch.Tensor, spec: ShardSpec, layout: Layout, name: str = "tensor") -> dict[tuple[int, int], torch.Tensor]:
    """``{(ep_rank, tp_rank): shard}`` for one tensor (one entry per rank that holds a piece)."""
    tp = spec.tp_size(layout)
    if spec.expert_dim is not None and spec.shared:
        ep_blocks = [t] * layout.ep  # a shared factor: replicated on every EP rank
    elif spec.expert_dim is not None:
        ep_blocks = split_dim(t, layout.ep, spec.expert_dim, f"{name} (experts over EP={layout.ep})")
    else:
        ep_blocks = [t]
    out = {}
    for e, block in enumerate(ep_blocks):
        if spec.tp_dim is None:
            pieces = [block] * tp
        elif spec.fused:
            pieces = split_fused(block, spec.fused, tp, spec.tp_dim, name)
        else:
            pieces = split_dim(block, tp, spec.tp_dim, f"{name} (TP={tp})")
        for r, piece in enumerate(pieces):
            out[(e, r)] = piece
    return out


def unshard(shards: Mapping[tuple[int, int], torch.Tensor], spec: ShardSpec, layout: Layout,
            name: str = "tensor") -> torch.Tensor:
    """Inverse of ``shard``; replicated copies must agree (else the ranks diverged: an error)."""
    tp = spec.tp_size(layout)
    n_ep = layout.ep if spec.expert_dim is not None else 1
    expected = {(e, r) for e in range(n_ep) for r in range(tp)}
    if set(shards) != expected:
        raise ShardingError(f"{name}: have shards {sorted(shards)}, expected {sorted(expected)}")
    blocks = []
    for e in range(n_ep):
        pieces = [shards[(e, r)] for r in range(tp)]
        if spec.tp_dim is None:
            _same(pieces, f"{name} (replicated over TP, EP rank {e})")
            blocks.append(pieces[0])
        elif spec.fused:
            blocks.append(join_fused(pieces, spec.fused, spec.tp_dim))
        else:
            blocks.append(torch.cat(pieces, dim=spec.tp_dim))
    if spec.expert_dim is not None and spec.shared:
        _same(blocks, f"{name} (shared factor replicated over EP)")
        return blocks[0]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=spec.expert_dim)


def reshard(shards: Mapping[tuple[int, int], torch.Tensor], spec: ShardSpec, src: Layout, dst: Layout,
            name: str = "tensor") -> dict[tuple[int, int], torch.Tensor]:
    """Trainer layout -> engine layout (join, then split)."""
    return shard(unshard(shards, spec, src, name), spec, dst, name)


def _same(tensors: Sequence[torch.Tensor], what: str) -> None:
    for i, t in enumerate(tensors[1:], 1):
        if t.shape != tensors[0].shape or not torch.equal(t, tensors[0]):
            raise ShardingError(f"{what}: copy {i} differs from copy 0")


# ---- EP expert ids -----------------------------------------------------------------------------


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    if num_experts % ep:
        raise ShardingError(f"{num_experts} experts do not split over EP={ep}")
    per = num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def to_local_expert_ids(global_ids: torch.Tensor, num_experts: int, ep: int, ep_rank: int) -> torch.Tensor:
    """Global expert ids -> this rank's local ids; experts of other ranks get the sentinel ``E/ep``
    (transformers' grouped_mm experts skip ids >= num_experts, which is exactly its EP contract)."""
    own = local_experts(num_experts, ep, ep_rank)
    local = global_ids - own.start
    return torch.where((global_ids >= own.start) & (global_ids < own.stop), local,
                       torch.full_like(global_ids, len(own)))


# ---- specs for the model's tensor names --------------------------------------------------------

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_a_proj", "q_b_proj",
           "kv_a_proj_with_mqa", "kv_b_proj", "w1", "w3", "linear_qkv", "linear_fc1")
_ROW = ("o_proj", "down_proj", "w2", "linear_proj", "linear_fc2")


def spec_for(name: str, shape: Sequence[int]) -> ShardSpec:
    """The shard spec of a tensor of the embedded model, from its (plain or PEFT or canonical) name.

    Expert tensors (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) and their
    canonical LoRA factors (``experts.<p>.lora_A`` [E|1, r, in], ``.lora_B`` [E|1, out, r]) shard
    over EP and ETP; dense linears over TP; everything else (norms, router, embeddings) is replicated.
    """
    if ".experts." in name or name.startswith("experts."):
        is_gate_up = "gate_up_proj" in name
        shared = len(shape) == 3 and shape[0] == 1
        if "lora_A" in name:
            # column-parallel base: A replicated; row-parallel base: A split on in (last dim)
            return ShardSpec(None if is_gate_up else 2, None, 0, "etp", shared)
        if "lora_B" in name:
            if is_gate_up:
                return ShardSpec(1, (shape[1] // 2, shape[1] // 2), 0, "etp", shared)
            return ShardSpec(None, None, 0, "etp", shared)
        if is_gate_up:
            return ShardSpec(1, (shape[1] // 2, shape[1] // 2), 0, "etp")
        if name.endswith("down_proj"):
            return ShardSpec(2, None, 0, "etp")
        return ShardSpec(expert_dim=0, group="etp")
    leaf = _linear_of(name)
    if leaf is None or len(shape) != 2:
        return REPLICATED
    column = leaf in _COLUMN
    if "lora_A" in name:
        return REPLICATED if column else ShardSpec(1)
    if "lora_B" in name:
        return ShardSpec(0) if column else REPLICATED
    return ShardSpec(0) if column else ShardSpec(1)


def _linear_of(name: str) -> str | None:
    for part in reversed(name.split(".")):
        if part in _COLUMN or part in _ROW:
            return part
    return None


# ---- fused qkv (Megatron linear_qkv) ------------------------------------------------------------


def qkv_sizes(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    return num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v weights (or LoRA B factors) -> one fused [q|k|v] tensor on dim 0.

    Megatron interleaves q/k/v per query group; the segment layout here is the simpler HF-concat one,
    and ``split_fused`` shards it head-aligned as long as TP divides the KV heads."""
    return torch.cat([q, k, v], dim=0)


# ---- pipeline stages ---------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous decoder-layer blocks per stage (first stages take the remainder, as Megatron's
    default uneven split would put it)."""
    if pp < 1 or pp > num_layers:
        raise ShardingError(f"pipeline: {pp} stages for {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_of(name: str, num_layers: int, pp: int) -> int:
    """Which stage owns ``name``: its decoder layer's stage; embeddings -> 0; final norm/head -> last."""
    m = _LAYER_RE.search(name)
    if m is None:
        return 0 if "embed" in name else pp - 1
    layer = int(m.group(1))
    for s, rng in enumerate(stage_layers(num_layers, pp)):
        if layer in rng:
            return s
    raise ShardingError(f"{name}: layer {layer} is outside the model's {num_layers} layers")


def split_stages(tensors: Mapping[str, torch.Tensor], num_layers: int, pp: int) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(pp)]
    for name, t in tensors.items():
        out[stage_of(name, num_layers, pp)][name] = t
    return out


def gather_stages(stages: Sequence[Mapping[str, torch.Tensor]], num_layers: int) -> dict[str, torch.Tensor]:
    """Refit's gather over PP: every stage sends the adapters of its own layers; each name must come
    from exactly the stage that owns it."""
    pp = len(stages)
    out: dict[str, torch.Tensor] = {}
    for s, tensors in enumerate(stages):
        for name, t in tensors.items():
            owner = stage_of(name, num_layers, pp)
            if owner != s:
                raise ShardingError(f"{name}: sent by pipeline stage {s} but owned by stage {owner}")
            if name in out:
                raise ShardingError(f"{name}: sent by two pipeline stages")
            out[name] = t
    return out


# ---- Megatron-Bridge's export of expert adapters to per-expert (vLLM) names ----------------------


def bridge_export_expert_factor(gathered: Sequence[torch.Tensor], num_experts: int) -> torch.Tensor:
    """``[E, ...]``: the factor vLLM receives for each global expert, laid out as Megatron-Bridge
    exports it (megatron-bridge 0.6: models/conversion/peft_bridge.py ``_gather_expert_adapter_weight``
    all-gathers the factor over EP, ``_select_expert_adapter_weight`` picks for expert e the copy of
    its owning EP rank ``e // (E / EP)``, and the local slice when the factor is per expert).

    ``gathered[r]``: EP rank r's factor, ``[E/EP, ...]`` per expert or a 2-D shared factor. A shared
    factor therefore reaches vLLM as EP rank r's copy under every name of rank r's experts: one
    adapter per MoE layer only while the EP ranks' copies are identical."""
    ep = len(gathered)
    if num_experts % ep:
        raise ShardingError(f"{num_experts} experts do not split over EP={ep}")
    per = num_experts // ep
    out = []
    for e in range(num_experts):
        w = gathered[e // per]
        out.append(w[e % per] if w.ndim > 2 else w)
    return torch.stack(out)
