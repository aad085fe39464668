import numpy as np
import pytest
import torch

from replay_helpers import PRESETS, random_ids, random_trace, small_model, tokenizer
from moerl.config import LoraConfig
from moerl.lora.peft_lora import apply_lora
from moerl.models.routers import find_moe_layers
from moerl.replay.capture import record_generation
from moerl.replay.diagnostics import ReplayViolation, routing_agreement, routing_metrics
from moerl.replay.engine_output import trace_from_vllm
from moerl.replay.session import routing_session
from moerl.replay.trace import RoutingTrace, TraceError

N, T = 3, 6


def record(model, ids, valid=None):
    with torch.no_grad(), routing_session(model, ids.shape) as s:
        logits = model(ids).logits
    return logits, s.to_trace(torch.ones(ids.shape, dtype=torch.bool) if valid is None else valid)


@pytest.mark.parametrize("preset", PRESETS)
def test_replaying_own_routing_reproduces_logits_exactly(preset):
    model, ids = small_model(preset), random_ids(N, T)
    logits, trace = record(model, ids)
    with torch.no_grad(), routing_session(model, ids.shape, replay=trace, strict=True) as s:
        again = model(ids).logits
    assert torch.equal(logits, again)
    assert s.violations == 0 and s.replay_trace is trace
    assert routing_agreement(s.received, trace) == {x: 1.0 for x in trace.moe_layers}


@pytest.mark.parametrize("preset", PRESETS)
def test_replayed_experts_are_used_and_router_gets_gradients(preset):
    model, ids = small_model(preset), random_ids(N, T)
    layers = find_moe_layers(model)
    e, k = layers[0].num_experts, layers[0].top_k
    other = random_trace(N, T, tuple(x.layer_number for x in layers), e, k, seed=5)
    _, native = record(model, ids)
    with routing_session(model, ids.shape, replay=other, strict=True) as s:
        model(ids).logits.float().pow(2).mean().backward()
    for number in other.moe_layers:
        idx, valid = other.layer(number)
        assert torch.equal(s.received[number][valid], idx[valid])  # the trace, in its column order
        assert torch.equal(s.received[number][~valid], s.native[number][~valid])  # native fallback
    # The first MoE layer's native choice is unaffected by replay (later ones see replayed hidden states).
    first = other.moe_layers[0]
    assert torch.equal(s.native[first], native.layer(first)[0])
    assert s.violations == 0
    for layer in layers:
        grad = layer.block.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0, f"layer {layer.layer_number}: no router gradient"


def test_replay_weights_follow_the_family_rule_on_deepseek_group_limited_routing():
    # n_group=2, topk_group=1: native picks both experts inside one group of 4. Replay one expert from
    # each group, i.e. outside the native group, and check the gate weights the experts received.
    model, ids = small_model("deepseek_v3"), random_ids(N, T)
    layers = find_moe_layers(model)
    assert [x.layer_number for x in layers] == [1, 2]  # first_k_dense=1
    _, native = record(model, ids)
    native_groups = native.indices.long() // 4
    assert (native_groups[..., 0] == native_groups[..., 1]).all()  # group-limited indeed
    idx = torch.zeros(N, T, 2, 2, dtype=torch.uint8)
    idx[..., 0] = 6
    idx[..., 1] = 1
    trace = RoutingTrace(idx, torch.ones(N, T, dtype=torch.bool), (1, 2), 8, 2)
    seen, logits = {}, {}
    with torch.no_grad(), routing_session(model, ids.shape, replay=trace, strict=True) as s:
        # Registered after the session's hooks, so they see what the session passed on.
        hooks = [x.block.experts.register_forward_pre_hook(
            lambda m, a, number=x.layer_number: seen.__setitem__(number, (a[1].clone(), a[2].clone())))
            for x in layers]
        hooks += [x.block.gate.register_forward_hook(
            lambda m, a, out, number=x.layer_number: logits.__setitem__(number, out.detach())) for x in layers]
        try:
            out = model(ids).logits
        finally:
            for h in hooks:
                h.remove()
    assert torch.isfinite(out).all() and s.violations == 0
    for layer in layers:
        got_idx, got_w = seen[layer.layer_number]
        assert got_idx.tolist() == [[6, 1]] * (N * T)
        w = torch.sigmoid(logits[layer.layer_number].float())[:, [6, 1]]  # bias does not enter the weights
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * layer.block.routed_scaling_factor
        torch.testing.assert_close(got_w, w, rtol=0, atol=0)


def test_wrong_layer_mapping_by_position_is_detected():
    # A vLLM-style engine array covers all 3 decoder layers (layer 0 dense, zero-filled). A buggy
    # replay that maps the i-th MoE router to engine column i (position) instead of its layer number:
    model, ids = small_model("deepseek_v3"), random_ids(N, T)
    layers = find_moe_layers(model)
    rng = np.random.default_rng(0)
    full = np.stack([rng.permutation(8)[:2] for _ in range(N * T * 3)]).reshape(N, T, 3, 2)
    full[:, :, 0] = 0
    trace = RoutingTrace(torch.from_numpy(full[:, :, [1, 2]]).to(torch.uint8),
                         torch.ones(N, T, dtype=torch.bool), (1, 2), 8, 2)

    def buggy(position):
        def hook(module, args):
            col = torch.from_numpy(full[:, :, position]).reshape(N * T, 2)
            col = torch.where(col[:, :1] == col[:, 1:], torch.tensor([0, 1]), col)  # no duplicates either
            return (args[0], col.to(args[1].dtype), args[2])
        return hook

    with torch.no_grad(), routing_session(model, ids.shape, replay=trace) as s:
        handles = [x.block.experts.register_forward_pre_hook(buggy(pos)) for pos, x in enumerate(layers)]
        try:
            model(ids)
        finally:
            for h in handles:
                h.remove()
    assert s.violations > 0 and set(s.layer_violations) == {1, 2}
    metrics = routing_metrics(s, trace, trace)
    assert metrics["routing/violations"] == s.violations and metrics["routing/replayed_agreement"] < 1.0
    with torch.no_grad(), routing_session(model, ids.shape, replay=trace, strict=True) as s:
        h = layers[0].block.experts.register_forward_pre_hook(buggy(0))
        try:
            with pytest.raises(ReplayViolation, match=r"layer 1, sample 0, token 0: experts received"):
                model(ids)
        finally:
            h.remove()


def test_peft_wrapped_model_replays_and_trains_lora_experts():
    model = small_model("qwen3_moe")
    peft_model = apply_lora(model, LoraConfig(rank=4, alpha=8), "qwen3_moe")
    ids = random_ids(N, T)
    layers = find_moe_layers(peft_model)
    assert type(layers[0].block.experts).__name__ == "ParamWrapper"  # hooks sit on the wrapper
    logits, trace = record(peft_model, ids)
    other = random_trace(N, T, trace.moe_layers, 8, 2, seed=3)
    with routing_session(peft_model, ids.shape, replay=other, strict=True) as s:
        peft_model(ids).logits.pow(2).mean().backward()
    assert s.violations == 0 and len(s.received) == len(layers)
    grads = [p.grad for n, p in peft_model.named_parameters() if "lora_" in n and "experts" in n]
    assert grads and all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    with torch.no_grad(), routing_session(peft_model, ids.shape, replay=trace) as s2:
        assert torch.equal(peft_model(ids).logits, logits)
    assert s2.violations == 0 and len(s2.received) == len(layers)  # its own routes replayed, every layer


@pytest.mark.parametrize("preset", ["qwen3_moe", "deepseek_v3"])
def test_r2_record_full_batch_replay_per_micro_batch(preset):
    model, ids = small_model(preset), random_ids(6, T, seed=1)
    # Old-logprob pass in micro-batches of 4 and 2, recordings concatenated (as the trainer does).
    parts, full_logits = [], []
    for rows in (torch.arange(0, 4), torch.arange(4, 6)):
        logit, tr = record(model, ids[rows])
        parts.append(tr)
        full_logits.append(logit)
    recorded = RoutingTrace.cat(parts)
    # Perturb the router so native routing would now differ (an optimizer step happened).
    with torch.no_grad():
        for layer in find_moe_layers(model):
            layer.block.gate.weight.add_(torch.randn_like(layer.block.gate.weight))
    changed = 0
    for rows in (torch.tensor([5, 0, 3]), torch.tensor([1, 2, 4])):  # other micro-batches, shuffled
        sub = recorded[rows]
        with routing_session(model, (len(rows), T), replay=sub, strict=True) as s:
            model(ids[rows]).logits.sum().backward()
        for number in recorded.moe_layers:
            assert torch.equal(s.received[number], recorded.layer(number)[0][rows])
            changed += int((s.native[number] != s.received[number]).any(-1).sum())
    assert changed > 0  # replay actually overrode the (perturbed) native routing


@pytest.mark.parametrize("how", ["hf", "torch"])
def test_activation_checkpointing_recompute_uses_identical_indices(how):
    model, ids = small_model("qwen3_moe"), random_ids(N, T)
    layers = find_moe_layers(model)
    model.train()
    if how == "hf":
        model.gradient_checkpointing_enable()
    else:
        from torch.utils.checkpoint import checkpoint
        for layer in model.model.layers:
            layer._orig_forward = layer.forward
            layer.forward = (lambda f: lambda *a, **kw: checkpoint(f, *a, use_reentrant=False, **kw))(
                layer._orig_forward)
    calls, hooks = {}, []
    # Make the recompute's *native* routing differ from the first forward's (as nondeterministic
    # kernels or a bf16 rounding change could): flip the gate's choice on every second call.
    gate_calls = {}

    def flip(module, args, out):
        gate_calls[id(module)] = gate_calls.get(id(module), 0) + 1
        if gate_calls[id(module)] % 2 == 0:
            return out[0], out[1], out[2].flip(-1).roll(1, dims=0)
    flips = [x.block.gate.register_forward_hook(flip, prepend=True) for x in layers]
    try:
        trace = random_trace(N, T, tuple(x.layer_number for x in layers), 8, 2, seed=9)
        with routing_session(model, ids.shape, replay=trace, strict=True) as s:
            # After the session's hooks: what each call (forward, then recompute) passed to the experts.
            hooks += [x.block.experts.register_forward_pre_hook(
                lambda m, a, number=x.layer_number: calls.setdefault(number, []).append(a[1].clone()))
                for x in layers]
            model(ids, use_cache=False).logits.pow(2).mean().backward()  # a cache would grow on recompute
    finally:
        for h in hooks + flips:
            h.remove()
    for layer in layers:
        assert len(calls[layer.layer_number]) == 2, "recompute did not run (is checkpointing on?)"
        first, again = calls[layer.layer_number]
        assert torch.equal(first, again)
        assert s.calls[layer.layer_number] == 2
    assert s.recompute_mismatches == 0 and s.violations == 0
    assert layers[0].block.gate.weight.grad.abs().sum() > 0


def test_session_rejects_traces_that_do_not_fit():
    model, ids = small_model("deepseek_v3"), random_ids(N, T)
    with pytest.raises(TraceError, match=r"trace covers \(3, 5\)"):
        with routing_session(model, ids.shape, replay=random_trace(N, T - 1, (1, 2), 8, 2)):
            pass
    with pytest.raises(TraceError, match=r"trace MoE layers \(0, 1\) != model MoE layers \(1, 2\)"):
        with routing_session(model, ids.shape, replay=random_trace(N, T, (0, 1), 8, 2)):
            pass
    with pytest.raises(TraceError, match="trace is for 16 experts top-2, model has 8 experts top-2"):
        with routing_session(model, ids.shape, replay=random_trace(N, T, (1, 2), 16, 2)):
            pass
    with pytest.raises(TraceError, match="MoE call saw 12 tokens, expected 3x6"):
        with routing_session(model, ids.shape):
            model(ids[:2])


def test_r3_without_a_captured_trace_is_refused_before_a_run():
    from moerl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="replay.mode=R3 needs rollout.capture_routing=true"):
        load_config("experiments/00_tiny_moe_cpu/arms/r3.yaml", ["rollout.capture_routing=false"])


def test_generation_capture_matches_trainer_and_r3_agreement_is_one():
    tok = tokenizer()
    model = small_model("deepseek_v3")
    ids = random_ids(4, 5, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = tok.pad_token_id
    torch.manual_seed(0)
    with torch.no_grad(), record_generation(model, 4) as rec:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True,
                             pad_token_id=tok.pad_token_id, eos_token_id=None)
    full_mask = torch.cat([mask, torch.ones(4, 4, dtype=mask.dtype)], 1)
    trace = rec.to_trace(full_mask)
    assert trace.moe_layers == (1, 2) and trace.shape[:2] == tuple(out.shape)
    assert not trace.valid[:, -1].any() and not trace.valid[0, :2].any() and trace.valid[1, :-1].all()
    # The same routes through the vLLM parser (rows = prompt + response - 1, all layers) agree.
    rows = []
    for i in range(4):
        cols = full_mask[i].bool().nonzero().flatten()[:-1]
        full = np.zeros((len(cols), 3, 2), dtype=np.int64)
        full[:, 1:] = trace.indices[i, cols].numpy()
        rows.append(full)
    parsed = trace_from_vllm(rows, full_mask, 5, (1, 2), 8, 2, 3)
    assert torch.equal(parsed.valid, trace.valid) and torch.equal(parsed.indices[parsed.valid], trace.indices[trace.valid])
    # Trainer (full forward, same fp32 weights) vs engine (KV-cache decode): agreement is a measurement;
    # under R3 the experts received equal the trace on every valid row.
    with torch.no_grad(), routing_session(model, out.shape, replay=trace, strict=True) as s:
        model(out, attention_mask=full_mask)
    m = routing_metrics(s, trace, trace)
    assert m["routing/replayed_agreement"] == 1.0 and m["routing/violations"] == 0
    assert 0.5 < m["routing/agreement"] <= 1.0


def _checkpointed(model):
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.parametrize("preset", PRESETS)
def test_checkpointed_replay_of_a_trace_equal_to_native_routing(preset):
    # The usual case: no row flipped, so the recompute's native top-k equals the replayed experts.
    # The recompute must still take the substituting path, or torch raises CheckpointError.
    model, ids = small_model(preset), random_ids(N, T)
    _, trace = record(model, ids)
    _checkpointed(model)
    with routing_session(model, ids.shape, replay=trace, strict=True) as s:
        model(ids, use_cache=False).logits.pow(2).mean().backward()
    assert all(c == 2 for c in s.calls.values()), "recompute did not run (is checkpointing on?)"
    assert s.violations == 0 and s.recompute_mismatches == 0


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_violations_are_counted_once_per_row_and_layer(reentrant):
    # A foreign hook overrides one layer's experts on the forward and on the recompute: each valid
    # row of that layer is one violation, not two (the trainer divides by valid rows x layers).
    # Reentrant checkpointing reruns the whole layer; non-reentrant stops the recompute after the last
    # saved tensor unless early stop is off, so both are forced to run the experts call again here.
    from torch.utils.checkpoint import set_checkpoint_early_stop

    model, ids = small_model("qwen3_moe"), random_ids(N, T)
    layers = find_moe_layers(model)
    trace = random_trace(N, T, tuple(x.layer_number for x in layers), 8, 2, seed=4)
    target = layers[1]
    idx, valid = trace.layer(target.layer_number)
    fixed = torch.tensor([[0, 1]]).expand(N * T, 2)
    differs = int(((idx.view(N * T, 2) != fixed).any(-1) & valid.reshape(-1)).sum())
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    runs = []
    with routing_session(model, ids.shape, replay=trace) as s, set_checkpoint_early_stop(False):
        hooks = [target.block.experts.register_forward_pre_hook(
            lambda m, a: (a[0], fixed.to(a[1].dtype), a[2]) + tuple(a[3:])),
            target.block.experts.register_forward_hook(lambda m, a, out: runs.append(1))]
        try:
            model(ids, use_cache=False).logits.pow(2).mean().backward()
        finally:
            for h in hooks:
                h.remove()
    assert len(runs) == 2, "the recompute did not run the experts call"
    assert differs > 0 and s.violations == differs and s.layer_violations == {target.layer_number: differs}


def test_repeated_experts_collapse_into_one_weight_as_megatron_does():
    from moerl.models.routers import collapse_repeated

    index = torch.tensor([[0, 0, 0, 0], [3, 1, 2, 0], [5, 1, 5, 5]])
    weights = torch.full((3, 4), 0.25)
    out = collapse_repeated(index, weights)
    assert out.tolist() == [[0.25, 0, 0, 0], [0.25] * 4, [0.25, 0.25, 0, 0]]
    assert torch.equal(collapse_repeated(index[1:2], weights[1:2]), weights[1:2])


def test_position_mapping_reproduces_the_r3_bug_on_a_dense_first_layer_model():
    # DeepSeek-V3 family: layer 0 dense, MoE layers 1 and 2. Mapped by position, MoE layer 1 reads the
    # dense layer's zero-filled column (expert 0 twice, collapsed to one weight) and MoE layer 2 reads
    # layer 1's routes; the session reports no violation, as the bug did.
    model, ids = small_model("deepseek_v3"), random_ids(N, T)
    logits, trace = record(model, ids)
    seen = {}
    layers = find_moe_layers(model)
    with torch.no_grad(), routing_session(model, ids.shape, replay=trace, layer_mapping="position") as s:
        hooks = [x.block.experts.register_forward_pre_hook(
            lambda m, a, number=x.layer_number: seen.__setitem__(number, (a[1].clone(), a[2].clone())))
            for x in layers]
        try:
            buggy = model(ids).logits
        finally:
            for h in hooks:
                h.remove()
    idx1, w1 = seen[1]
    assert idx1.tolist() == [[0, 0]] * (N * T)
    assert (w1[:, 1] == 0).all() and (w1[:, 0] > 0).all()  # expert 0 once, with one weight
    assert torch.equal(seen[2][0].long(), trace.layer(1)[0].reshape(N * T, 2))
    assert s.violations == 0
    assert not torch.allclose(buggy, logits)
    # The trainer's native routing against the trace is what gives it away.
    assert routing_agreement(s.native, trace)[2] < 1.0
    with pytest.raises(ValueError, match="unknown mapping 'pos'"):
        with routing_session(model, ids.shape, replay=trace, layer_mapping="pos"):
            pass
