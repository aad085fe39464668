"""Router Replay (R3) on megatron-core itself, driven by verl's own code, on the CPU or one GPU.

What runs here is upstream's: verl 0.9.1's ``apply_router_replay_patch`` (its ``RouterReplay`` inside
megatron-core 0.16.1's ``TopKRouter``), ``align_r3_router_replay_data`` (the placeholder row for the
last generated token), ``build_r3_replay_mask``, ``set_router_replay_data(..., model=)`` (routes to
routers by global layer number), ``set_model_router_replay_action`` and megatron-core's MoE layer,
allgather dispatcher and full activation recompute - in the order verl's
``MegatronEngine.forward_step`` calls them. The model has a dense first layer, so vLLM's
``routed_experts`` (``[T-1, num_hidden_layers, k]``, dense layers left 0) and the routers disagree
on positions; mapping by position is the bug that broke R3, shown on the same model below. R2
(RECORD, ``merge_router_topk_indices``, replay by MoE ordinal) runs on the same model.
On the CPU (the default, as in CI) only CUDA-device lookups are redirected (tests/upstream/megatron_harness.py);
with ``MOERL_TEST_DEVICE=cuda`` the model, batches and routes live on the GPU and nothing is redirected
(scripts/gpu_router_replay.sh). Each test records what it measured (``record_property``): per MoE layer,
how many replayed rows the router followed and how many its own top-k would have picked anyway.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (requirements/cpu.txt)")
pytest.importorskip("verl.utils.megatron.router_replay_utils", reason="verl is not installed")

from megatron_harness import (MOE_LAYER_FREQ, NUM_EXPERTS, NUM_LAYERS, TOP_K, VOCAB,  # noqa: E402
                               build_replay_model, megatron_on, packed_causal_mask, packed_position_ids,
                               requested_device)

MOE_LAYERS = tuple(i for i, moe in enumerate(MOE_LAYER_FREQ) if moe)  # global 0-based layer numbers
DEVICE = requested_device()  # MOERL_TEST_DEVICE: cpu (default) or cuda


@pytest.fixture(scope="module")
def megatron():
    with megatron_on(DEVICE):
        yield


@pytest.fixture
def replay_model(megatron):
    model, cfg = build_replay_model(device=DEVICE)
    yield model, cfg
    from verl.utils.megatron.router_replay_patch import RouterReplay
    RouterReplay.router_instances.clear()


class RouterLog:
    """Forward hooks on every TopKRouter: which experts each call selected (routing_map rows) and the
    experts its own logits would pick (the native top-k), keyed by the router's global layer index; kept
    on the CPU, where the tests compare them."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, TopKRouter)]

    def _hook(self, module, inputs, outputs):
        _, routing_map = outputs
        with torch.no_grad():
            logits = module.gating(inputs[0]).view(-1, module.config.num_moe_experts)
            native = torch.topk(logits, module.topk, dim=1).indices  # softmax after top-k: rank by logits
        self.calls.append((module.layer_number - 1, routing_map.detach().to("cpu", copy=True), native.cpu()))

    def close(self):
        for h in self.handles:
            h.remove()


def vllm_routes(lengths, seed=0) -> list[np.ndarray]:
    """What vLLM returns per sample: ``routed_experts`` int32 ``[prompt + response - 1, L, k]`` over all
    hidden layers, dense layers left 0; the MoE layers get random distinct experts per row."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        r = np.zeros((n - 1, NUM_LAYERS, TOP_K), dtype=np.int32)
        for layer in MOE_LAYERS:
            r[:, layer] = np.stack([rng.permutation(NUM_EXPERTS)[:TOP_K] for _ in range(n - 1)])
        out.append(r)
    return out


def one_hot(indices: torch.Tensor) -> torch.Tensor:
    return torch.zeros(indices.shape[0], NUM_EXPERTS, dtype=torch.bool).scatter(1, indices.long(), True)


def micro_batch(lengths, response_lengths, seed):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n,), generator=g).to(DEVICE) for n in lengths]
    input_ids = torch.nested.as_nested_tensor(ids, layout=torch.jagged)
    response_mask = torch.zeros(len(lengths), max(response_lengths), dtype=torch.long)
    for i, r in enumerate(response_lengths):
        response_mask[i, :r] = 1
    return input_ids, response_mask.to(DEVICE)


def forward_packed(model, input_ids, lengths):
    """The THD forward of verl's no-padding path: verl packs the jagged batch with
    ``preprocess_thd_engine``; attention is kept per sequence with a block-diagonal causal mask."""
    from verl.models.mcore.util import preprocess_thd_engine

    packed, _, _ = preprocess_thd_engine(input_ids, pre_process=True)
    assert packed.shape == (1, sum(lengths))  # TP=CP=1: no alignment padding
    return model(packed, packed_position_ids(lengths, DEVICE), attention_mask=packed_causal_mask(lengths, DEVICE))


def r3_forward_step(model, cfg, input_ids, response_mask, routes, lengths):
    """verl MegatronEngine.forward_step's R3 branch (verl/workers/engine/megatron/transformer_impl.py)."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import (RouterReplayHelper, align_r3_router_replay_data,
                                                         build_r3_replay_mask, set_model_router_replay_action,
                                                         set_router_replay_data)

    if RouterReplayHelper.is_replay_backward_action(cfg, 0, model=model):
        set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
    assert RouterReplayHelper.is_replay_forward_action(cfg, 0, model=model)
    routed = torch.nested.as_nested_tensor([torch.from_numpy(r).to(DEVICE) for r in routes], layout=torch.jagged)
    aligned = align_r3_router_replay_data(routed, input_ids)
    replay_mask = build_r3_replay_mask(input_ids, response_mask)
    set_router_replay_data(aligned, None, cfg, 0, replay_mask=replay_mask, model=model)
    out = forward_packed(model, input_ids, lengths)
    set_model_router_replay_action(model, RouterReplayAction.REPLAY_BACKWARD)
    return out


def expected_rows(routes, layer):
    """Per packed row: the route vLLM recorded for ``layer``, or None on each sample's last row
    (the last generated token, which the engine never forwarded: native routing there)."""
    rows = []
    for r in routes:
        rows += [r[t, layer] for t in range(r.shape[0])] + [None]
    return rows


def assert_router_followed(selected, native, rows):
    want = torch.stack([torch.as_tensor(r) if r is not None else native[i] for i, r in enumerate(rows)])
    assert torch.equal(selected, one_hot(want))


def replay_counts(phase, layer, selected, native, rows) -> dict:
    """One router call, over the rows that had a route to replay: how many the router followed exactly,
    and how many its own top-k (the native routing) would have picked anyway."""
    idx = [i for i, r in enumerate(rows) if r is not None]
    want = one_hot(torch.stack([torch.as_tensor(rows[i]) for i in idx]))
    return {"phase": phase, "layer": layer, "replayed_rows": len(idx),
            "router_followed": int((selected[idx] == want).all(-1).sum()),
            "native_agreed": int((one_hot(native[idx]) == want).all(-1).sum())}


def test_r3_replays_vllm_routes_by_global_layer_with_recompute(replay_model, record_property):
    """Two micro-batches forward, then both backwards (FIFO): every MoE router of the dense-first model
    picks vLLM's experts for its own global layer in the forward and again in the recompute, native
    top-k on each sample's last row, and the router still gets gradients."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import set_model_router_replay_action

    model, cfg = replay_model
    set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
    batches = [([7, 5], [3, 2], 1), ([6, 9, 4], [2, 5, 1], 2)]
    log = RouterLog(model)
    outputs, routes_per_mb = [], []
    for lengths, resp, seed in batches:
        input_ids, response_mask = micro_batch(lengths, resp, seed)
        routes = vllm_routes(lengths, seed)
        outputs.append(r3_forward_step(model, cfg, input_ids, response_mask, routes, lengths))
        routes_per_mb.append(routes)
    forward_calls, log.calls = log.calls, []
    for out in outputs:  # backward in micro-batch order: recompute pops replay_backward_list FIFO
        out.float().pow(2).mean().backward()
    recompute_calls = log.calls
    log.close()

    counts = []  # recorded before any assertion: a failing GPU run still reports what it saw
    for phase, calls in (("forward", forward_calls), ("recompute", recompute_calls)):
        for call, (layer, selected, native) in enumerate(calls):
            mb = call // len(MOE_LAYERS)  # backward runs in micro-batch order
            counts.append(replay_counts(phase, layer, selected, native, expected_rows(routes_per_mb[mb], layer)))
    record_property("r3_replay_counts", counts)

    assert [c[0] for c in forward_calls] == list(MOE_LAYERS) * 2
    assert [c[0] for c in recompute_calls] == list(MOE_LAYERS)[::-1] * 2  # full recompute re-ran every router
    differs = 0
    for calls in (forward_calls, recompute_calls):
        for call, (layer, selected, native) in enumerate(calls):
            rows = expected_rows(routes_per_mb[call // len(MOE_LAYERS)], layer)
            assert_router_followed(selected, native, rows)
            differs += sum(r is not None and set(r.tolist()) != set(native[i].tolist()) for i, r in enumerate(rows))
    assert differs > 0.5 * 2 * sum(sum(lengths) for lengths, _, _ in batches) * len(MOE_LAYERS)  # replay mattered
    for m in model.modules():
        if getattr(m, "router_replay", None) is not None:
            assert m.router_replay.replay_backward_list == []  # every recompute consumed its own entry
            assert m.weight.grad is not None and m.weight.grad.abs().sum() > 0


def test_routes_mapped_by_position_give_each_router_another_layers_routes(replay_model):
    """The bug on the same model: vLLM's layer axis counts dense layers, the routers do not. Handing
    the i-th router the i-th layer column (verl's positional ``RouterReplay.set_replay_data``) makes the
    first MoE router replay the dense layer's zeros (one expert, duplicated) and every later one the
    routes of the layer before it."""
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, set_model_router_replay_action

    model, cfg = replay_model
    lengths, resp = [7, 5], [3, 2]
    input_ids, _ = micro_batch(lengths, resp, 1)
    routes = vllm_routes(lengths, 1)
    full = [np.concatenate([r, r[-1:]]) for r in routes]  # replay every row here, the last one included
    routed = torch.nested.as_nested_tensor([torch.from_numpy(r).to(DEVICE) for r in full], layout=torch.jagged)
    aligned = align_r3_router_replay_data(routed, input_ids)
    packed_routes = preprocess_thd_engine(aligned, pre_process=True)[0][0]  # [tokens, L, k]
    assert len(RouterReplay.router_instances) == len(MOE_LAYERS)
    RouterReplay.set_replay_data([packed_routes[:, i].long() for i in range(len(MOE_LAYERS))])  # by position
    set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
    log = RouterLog(model)
    with torch.no_grad():
        forward_packed(model, input_ids, lengths)
    log.close()
    layer_rows = [np.concatenate([f[:, layer] for f in full]) for layer in range(NUM_LAYERS)]
    for position, (layer, selected, _) in enumerate(log.calls):
        assert layer == MOE_LAYERS[position] == position + 1
        assert torch.equal(selected, one_hot(torch.as_tensor(layer_rows[position])))  # another layer's routes
        assert not torch.equal(selected, one_hot(torch.as_tensor(layer_rows[layer])))  # not its own
    first = log.calls[0][1]
    assert (first.sum(-1) == 1).all()  # the dense layer's zeros: expert 0 twice, top-2 collapsed to one expert


def test_moerl_trace_matches_the_routers_megatron_replays(replay_model):
    """The repo's own parsing of vLLM's output (moerl.replay.engine_output.trace_from_vllm, by global
    layer number) gives each MoE layer exactly the experts megatron-core's router replayed for it."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import set_model_router_replay_action

    from moerl.replay.engine_output import trace_from_vllm

    model, cfg = replay_model
    lengths, resp = [6, 8], [2, 4]
    input_ids, response_mask = micro_batch(lengths, resp, 3)
    routes = vllm_routes(lengths, 3)
    # The RolloutBatch layout of the same two samples (prompt left-padded to 6, response right-padded).
    prompt = [n - r for n, r in zip(lengths, resp)]
    t0, t1 = max(prompt), max(resp)
    attention = torch.zeros(2, t0 + t1, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt, resp)):
        attention[i, t0 - p:t0 + r] = 1
    trace = trace_from_vllm(routes, attention, t0, MOE_LAYERS, NUM_EXPERTS, TOP_K, NUM_LAYERS)
    set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
    log = RouterLog(model)
    with torch.no_grad():
        r3_forward_step(model, cfg, input_ids, response_mask, routes, lengths)
    log.close()
    for j, (layer, selected, _) in enumerate(log.calls):
        assert layer == trace.moe_layers[j]
        start = 0
        for i, n in enumerate(lengths):
            cols = attention[i].nonzero().squeeze(-1)[:-1]  # every real token but the last has a route
            assert trace.valid[i, cols].all() and not trace.valid[i, attention[i].nonzero()[-1]].any()
            assert torch.equal(selected[start:start + n - 1], one_hot(trace.indices[i, cols, j]))
            start += n


def test_r2_records_then_replays_by_moe_ordinal_after_the_weights_move(replay_model, record_property):
    """R2 on the same dense-first model: RECORD in the old-logprob pass, verl's
    ``merge_router_topk_indices`` gathers ``[tokens, n_moe_layers, k]`` (MoE layers only), the router
    weights then change (an optimizer step), and REPLAY_FORWARD with that record still picks the
    recorded experts: ``set_router_replay_data`` maps the MoE-only layer axis by MoE ordinal."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import (merge_router_topk_indices, set_model_router_replay_action,
                                                         set_router_replay_data)

    model, cfg = replay_model
    lengths = [7, 5, 6]
    input_ids, _ = micro_batch(lengths, [3, 2, 2], 4)
    set_model_router_replay_action(model, RouterReplayAction.RECORD)
    log = RouterLog(model)
    with torch.no_grad():
        forward_packed(model, input_ids, lengths)
    recorded_maps = {layer: selected for layer, selected, _ in log.calls}
    records: list = []
    merge_router_topk_indices(None, input_ids, records, cfg, 0, model=model)
    recorded = records[0]  # jagged [sample][tokens, n_moe_layers, k]
    flat = torch.cat(list(recorded.unbind())).cpu()
    assert flat.shape == (sum(lengths), len(MOE_LAYERS), TOP_K)
    for j, layer in enumerate(MOE_LAYERS):
        assert torch.equal(one_hot(flat[:, j]), recorded_maps[layer])  # the record is what each router did

    with torch.no_grad():  # the update moves the routers: native routing now differs
        for m in model.modules():
            if getattr(m, "router_replay", None) is not None:
                m.weight.add_(torch.randn_like(m.weight))
    log.calls = []
    set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
    set_router_replay_data(recorded, None, cfg, 0, model=model)
    with torch.no_grad():
        forward_packed(model, input_ids, lengths)
    log.close()
    record_property("r2_replay_counts", [replay_counts("replay", layer, selected, native, list(flat[:, j]))
                                         for j, (layer, selected, native) in enumerate(log.calls)])
    moved = 0
    for j, (layer, selected, native) in enumerate(log.calls):
        assert layer == MOE_LAYERS[j] and torch.equal(selected, recorded_maps[layer])
        moved += int((one_hot(native) != selected).any(-1).sum())
    assert moved > 0  # replay, not coincidence: the moved routers would have chosen otherwise
