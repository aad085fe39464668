"""Turn a rollout engine's per-request routed experts into a RoutingTrace aligned with the batch.

What the engines return (vLLM ``vllm/outputs.py`` ``CompletionOutput.routed_experts`` since 0.22; SGLang
``meta_info["routed_experts"]``; read in verl 0.9.1 ``verl/utils/megatron/router_replay_utils.py``):
- vLLM (``enable_return_routed_experts``): ``CompletionOutput.routed_experts``, numpy
  ``[prompt + response - 1, num_hidden_layers, top_k]``. Every decoder layer has a column; dense
  layers (DeepSeek-V3/Kimi-K2's first layers) are zero-filled. The last generated token has no row:
  no forward ever ran on it.
- SGLang (``return_routed_experts``): ``meta_info["routed_experts"]``, base64 of a flattened int32
  ``[num_tokens, num_hidden_layers, top_k]``; with ``routed_experts_start_len=s`` the rows cover
  positions ``[s, seq_len - 1)``.

The batch has the prompt left-padded to ``prompt_length`` columns and the response right-padded
after it. MoE columns are picked by *global layer number* (``moe_layers``), never by position.
A row count, layer count, top-k or expert id that does not fit raises a TraceError naming the
sample; nothing is truncated or zero-filled. Rows the engine reports as missing (all ids -1, the
NeMo-RL sentinel), rows before an SGLang start offset, the last generated token and padding are
marked invalid, so replay falls back to the trainer's native top-k there; so are rows that repeat an
expert id (counted in ``RoutingTrace.duplicate_rows``).
"""
from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from moerl.replay.trace import RoutingTrace, TraceError, index_dtype

log = logging.getLogger(__name__)


def batch_layout(attention_mask: torch.Tensor, prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_lens [N], response_lens [N]) from a left-padded prompt / right-padded response mask."""
    mask = attention_mask.bool()
    if mask.dim() != 2:
        raise TraceError(f"attention_mask must be [N, T], got shape {tuple(mask.shape)}")
    n, t = mask.shape
    if not 0 < prompt_length <= t:
        raise TraceError(f"prompt_length {prompt_length} outside (0, {t}]")
    prompt, response = mask[:, :prompt_length], mask[:, prompt_length:]
    p_len, r_len = prompt.sum(1), response.sum(1)
    cols_p = torch.arange(prompt_length)
    cols_r = torch.arange(t - prompt_length)
    left_ok = (prompt == (cols_p >= prompt_length - p_len[:, None])).all(1)
    right_ok = (response == (cols_r < r_len[:, None])).all(1)
    for i in range(n):
        if not left_ok[i]:
            raise TraceError(f"sample {i}: prompt is not left-padded (attention_mask[:prompt_length] = "
                             f"{prompt[i].int().tolist()})")
        if not right_ok[i]:
            raise TraceError(f"sample {i}: response is not right-padded (attention_mask[prompt_length:] = "
                             f"{response[i].int().tolist()})")
        if p_len[i] == 0:
            raise TraceError(f"sample {i}: empty prompt")
    return p_len, r_len


@dataclass(frozen=True)
class LayerLayout:
    """Which decoder layers are MoE, read from the model config, so the mapping of an engine's
    ``[tokens, num_hidden_layers, top_k]`` routes onto the trainer's routers is never guessed."""
    num_hidden_layers: int
    moe_layers: tuple[int, ...]  # global layer numbers
    num_experts: int
    top_k: int


def layer_layout(config) -> LayerLayout:
    """LayerLayout of a transformers config, by the family's own rule for which layers get an MoE block
    (transformers ``DeepseekV3DecoderLayer``: ``layer_idx >= first_k_dense_replace``;
    ``Qwen3MoeDecoderLayer``: not in ``mlp_only_layers`` and ``(layer_idx + 1) % decoder_sparse_step == 0``;
    Mixtral: every layer)."""
    kind = getattr(config, "model_type", None)
    n = int(config.num_hidden_layers)
    if kind in ("deepseek_v3", "kimi_k2"):
        freq = int(getattr(config, "moe_layer_freq", 1) or 1)
        moe = tuple(i for i in range(n) if i >= config.first_k_dense_replace and i % freq == 0)
        experts = config.n_routed_experts
    elif kind == "qwen3_moe":
        moe = tuple(i for i in range(n) if i not in config.mlp_only_layers and config.num_experts > 0
                    and (i + 1) % config.decoder_sparse_step == 0)
        experts = config.num_experts
    elif kind == "mixtral":
        moe, experts = tuple(range(n)), config.num_local_experts
    else:
        raise TraceError(f"layer_layout: no MoE layer rule for model_type '{kind}' "
                         f"(have deepseek_v3, kimi_k2, qwen3_moe, mixtral)")
    if not moe:
        raise TraceError(f"layer_layout: {kind} config with {n} layers has no MoE layer")
    return LayerLayout(n, moe, int(experts), int(config.num_experts_per_tok))


def _as_int64(rows, sample: int) -> np.ndarray:
    arr = rows.detach().cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TraceError(f"sample {sample}: routed experts must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def trace_from_engine_rows(rows: Sequence, attention_mask: torch.Tensor, prompt_length: int,
                           moe_layers: Sequence[int], num_experts: int, top_k: int, num_hidden_layers: int,
                           start_rows: Sequence[int] | None = None, source: str = "engine") -> RoutingTrace:
    """Align per-sample engine routes ``[rows, num_hidden_layers, top_k]`` to the batch.

    ``rows[i]`` covers token positions ``start_rows[i] .. P_i + R_i - 2`` of sample i's unpadded
    sequence (prompt then response); ``None`` means the engine captured nothing for that sample.
    """
    moe_layers = tuple(int(x) for x in moe_layers)
    n, t = attention_mask.shape
    if len(rows) != n:
        raise TraceError(f"{source}: got routes for {len(rows)} samples, batch has {n}")
    bad_layers = [x for x in moe_layers if not 0 <= x < num_hidden_layers]
    if bad_layers:
        raise TraceError(f"{source}: MoE layer numbers {bad_layers} outside 0..{num_hidden_layers - 1}")
    dense = [x for x in range(num_hidden_layers) if x not in moe_layers]
    p_len, r_len = batch_layout(attention_mask, prompt_length)
    starts = [0] * n if start_rows is None else [int(s) for s in start_rows]
    if len(starts) != n:
        raise TraceError(f"{source}: start_rows has {len(starts)} entries, batch has {n}")

    idx = np.zeros((n, t, len(moe_layers), top_k), dtype=np.int64)
    valid = np.zeros((n, t), dtype=bool)
    duplicate_rows = 0
    for i, sample_rows in enumerate(rows):
        p, r = int(p_len[i]), int(r_len[i])
        # Batch column of each position of the unpadded sequence: prompt right-aligned, response after.
        cols = np.concatenate([np.arange(prompt_length - p, prompt_length), np.arange(prompt_length, prompt_length + r)])
        routed = p + r - 1  # the last token never went through a forward
        if sample_rows is None:
            continue
        arr = _as_int64(sample_rows, i)
        if arr.ndim != 3:
            raise TraceError(f"{source} sample {i}: routed experts must be [tokens, layers, top_k], got shape "
                             f"{arr.shape}")
        if arr.shape[1] != num_hidden_layers:
            raise TraceError(f"{source} sample {i}: {arr.shape[1]} layers in the routes, the model has "
                             f"{num_hidden_layers} (dense layers included)")
        if arr.shape[2] != top_k:
            raise TraceError(f"{source} sample {i}: top-k {arr.shape[2]} in the routes, the model routes "
                             f"top-{top_k}")
        s = starts[i]
        if not 0 <= s <= routed:
            raise TraceError(f"{source} sample {i}: start row {s} outside [0, {routed}]")
        if arr.shape[0] != routed - s:
            raise TraceError(f"{source} sample {i}: {arr.shape[0]} token rows, expected {routed - s} "
                             f"(prompt {p} + response {r} - 1 - start {s})")
        if dense:
            # The engines never write a dense layer's column: it stays zero-filled (or -1 on a row the
            # engine reports as missing). Anything else there means the routes are laid out by another
            # layer mapping (e.g. MoE routes packed by position), whatever top-k is; with top-1 a
            # "distinct experts" test could not tell.
            d = arr[:, dense]
            filled = (d == 0).all(-1) | (d < 0).all(-1)
            if not filled.all():
                tok, col = np.argwhere(~filled)[0]
                raise TraceError(f"{source} sample {i}, token {s + tok}: layer {dense[col]} is dense in the model "
                                 f"but carries experts {arr[tok, dense[col]].tolist()} (a dense layer's column is "
                                 f"zero-filled); the routes' layer layout does not match MoE layers {moe_layers}")
        moe = arr[:, list(moe_layers)]  # by global layer number
        missing = (moe < 0).all(axis=(1, 2))
        partial = (moe < 0).any(axis=(1, 2)) & ~missing
        if partial.any():
            tok = int(np.argmax(partial))
            raise TraceError(f"{source} sample {i}, token {s + tok}: negative expert ids in some layers only "
                             f"({moe[tok].tolist()})")
        too_big = (moe >= num_experts) & ~missing[:, None, None]
        if too_big.any():
            tok, col, _ = np.argwhere(too_big)[0]
            raise TraceError(f"{source} sample {i}, token {s + tok}, layer {moe_layers[col]}: expert id "
                             f"{int(moe[tok, col].max())} out of range [0, {num_experts})")
        # A row that repeats an expert in some MoE layer cannot be replayed (a top-k never repeats one):
        # that row falls back to the trainer's native routing and is counted, the rest of the batch
        # replays. verl does the same per token with a replay mask (verl
        # utils/megatron/router_replay_utils.py ``build_r3_replay_mask`` + ``RouterReplay.get_replay_topk``:
        # torch.where(mask, replayed, native)).
        srt = np.sort(moe, axis=-1)
        dup = (srt[..., 1:] == srt[..., :-1]).any(axis=(1, 2)) & ~missing
        duplicate_rows += int(dup.sum())
        target = cols[s:routed]
        idx[i, target] = np.where((missing | dup)[:, None, None], 0, moe)
        valid[i, target] = ~(missing | dup)
    if duplicate_rows:
        log.warning("%s: %d token rows repeat an expert id in some MoE layer; they use native routing",
                    source, duplicate_rows)
    return RoutingTrace(torch.from_numpy(idx).to(index_dtype(num_experts)), torch.from_numpy(valid),
                        moe_layers, num_experts, top_k, duplicate_rows=duplicate_rows)


def trace_from_vllm(routed_experts: Sequence, attention_mask: torch.Tensor, prompt_length: int,
                    moe_layers: Sequence[int], num_experts: int, top_k: int,
                    num_hidden_layers: int) -> RoutingTrace:
    """``routed_experts[i]`` = ``RequestOutput.outputs[0].routed_experts`` of sample i."""
    return trace_from_engine_rows(routed_experts, attention_mask, prompt_length, moe_layers, num_experts, top_k,
                                  num_hidden_layers, source="vllm")


def decode_sglang_routed_experts(encoded: str | bytes, num_hidden_layers: int, top_k: int,
                                 sample: int = 0) -> np.ndarray:
    """SGLang ``meta_info["routed_experts"]`` (base64 int32, flattened) -> ``[tokens, L, K]``."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (ValueError, TypeError) as err:
        raise TraceError(f"sglang sample {sample}: routed_experts is not valid base64 ({err})") from None
    if len(raw) % 4:
        raise TraceError(f"sglang sample {sample}: {len(raw)} bytes is not a whole number of int32")
    flat = np.frombuffer(raw, dtype="<i4")
    per_token = num_hidden_layers * top_k
    if flat.size % per_token:
        raise TraceError(f"sglang sample {sample}: {flat.size} ids is not a multiple of layers x top_k = "
                         f"{num_hidden_layers} x {top_k}")
    return flat.reshape(-1, num_hidden_layers, top_k)


def encode_sglang_routed_experts(routes: np.ndarray) -> str:
    """The engine side of the format (for tests and the embedded engine's SGLang-compatible output)."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype="<i4").tobytes()).decode("ascii")


def trace_from_sglang(meta_infos: Sequence[dict], attention_mask: torch.Tensor, prompt_length: int,
                      moe_layers: Sequence[int], num_experts: int, top_k: int,
                      num_hidden_layers: int) -> RoutingTrace:
    """``meta_infos[i]`` = sample i's ``meta_info`` (``routed_experts`` and optional start length)."""
    rows, starts = [], []
    for i, meta in enumerate(meta_infos):
        enc = meta.get("routed_experts")
        rows.append(None if enc is None else
                    decode_sglang_routed_experts(enc, num_hidden_layers, top_k, sample=i))
        starts.append(int(meta.get("routed_experts_start_len") or 0))
    return trace_from_engine_rows(rows, attention_mask, prompt_length, moe_layers, num_experts, top_k,
                                  num_hidden_layers, start_rows=starts, source="sglang")
