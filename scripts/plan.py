"""Capacity plan of a scale experiment: parameters, per-GPU memory, refit and routing-trace bytes.

    python scripts/plan.py experiments/01_kimi_k2_lora_grpo
    python scripts/plan.py experiments/03_qwen3_30b_a3b_lora_mitigations --arm r3

Composes the experiment against verl's config exactly as the launcher does, then does arithmetic
on the model's public config (src/moerl/models/public_configs). Exits 1 when the layout does not
fit the declared GPU memory, saying by how much; 2 when the experiment does not compose.
"""
from __future__ import annotations

import argparse
import sys

from moerl import planner


def fmt_n(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3f}{unit}"
    return str(int(x))


def fmt_b(x: float) -> str:
    for unit, div in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{int(x)} B"


def report(p: planner.Plan, lay: planner.Layout, cfg: dict) -> str:
    pc = p.params
    pub = cfg.get("_published", {})
    out = [f"model {p.model} ({cfg['_path']})"]
    out.append(f"  params total  {fmt_n(pc.total)}" + (f"  (published {fmt_n(pub['total_params'])}, "
               f"{pc.total / pub['total_params'] - 1:+.2%})" if pub else ""))
    out.append(f"  params active {fmt_n(pc.active)}" + (f"  (published {fmt_n(pub['active_params'])}, "
               f"{pc.active / pub['active_params'] - 1:+.2%})" if pub else ""))
    if pc.mtp:
        out.append(f"  MTP module    {fmt_n(pc.mtp)} (not in total)")
    out.append(f"  MoE layers    {pc.num_moe_layers} of {cfg['num_hidden_layers']} "
               f"(first MoE layer {planner.moe_layer_indices(cfg)[0]}), {planner.num_experts(cfg)} experts, "
               f"top-{cfg['num_experts_per_tok']}")
    if p.lora:
        lo = p.lora
        out.append(f"  LoRA r={lay.lora_rank} ({lay.expert_mode} expert adapters) {fmt_n(lo.total)}: attention "
                   f"{fmt_n(lo.attention)}, dense MLP {fmt_n(lo.dense_mlp)}, shared experts "
                   f"{fmt_n(lo.shared_experts)}, routed experts {fmt_n(lo.routed_experts)}")
        if lay.expert_mode == "shared":
            out.append(f"    routed experts: one trained adapter per MoE layer; Megatron-Bridge stores a copy on each of "
                       f"the EP{lay.ep} ranks and keeps them identical (broadcast + EP grad all-reduce: Bridge 0.6.x with "
                       f"gradient-accumulation fusion off)")
    out.append(f"layout: {lay.n_gpus} GPUs x {lay.gpu_mem_gib:.0f} GiB; trainer TP{lay.tp} PP{lay.pp} CP{lay.cp} "
               f"EP{lay.ep} ETP{lay.etp} (DP {lay.dp}); rollout vLLM TP{lay.rollout_tp} EP{lay.rollout_ep} "
               f"DP{lay.rollout_dp}")
    out.append(f"trainer per GPU (peak, during the update): {p.trainer_gib:.1f} GiB")
    out += [f"  {m.name:55s} {m.gib:8.2f} GiB  {m.note}" for m in p.trainer]
    out.append(f"  resident while vLLM runs (colocated): {p.trainer_resident_during_rollout_gib:.1f} GiB")
    out.append(f"  host RAM for offloaded params/grads/optimizer + vLLM sleep copy: {p.host_offload_gib_per_node:.1f} GiB per node "
               f"({lay.gpus_per_node} GPUs)" + (f" of {lay.host_mem_gib:.0f} GiB" if lay.host_mem_gib else ""))
    out.append(f"rollout per GPU: {p.rollout_gib:.1f} GiB (KV cache holds {p.rollout_kv_tokens:,.0f} tokens per replica)")
    out += [f"  {m.name:55s} {m.gib:8.2f} GiB  {m.note}" for m in p.rollout]
    out.append("refit per step:")
    if p.lora:
        out.append(f"  adapter-only {fmt_b(p.refit_adapter_bytes)} (per-expert layout vLLM loads)")
    out.append(f"  merged       {fmt_b(p.refit_merged_bytes)} total, {fmt_b(p.refit_merged_per_rollout_rank_bytes)} "
               f"per rollout TP rank")
    if p.lora and p.refit_adapter_bytes:
        out.append(f"  merged / adapter = {p.refit_merged_bytes / p.refit_adapter_bytes:.1f}x")
    for title, lines, total in (("refit receive side, every step", p.refit_receive, p.refit_receive_gib),
                                ("refit receive side, base sync (once)", p.refit_base_sync, p.refit_base_sync_gib)):
        if lines:
            out.append(f"{title}: {total:.1f} GiB of {p.gpu_mem_gib:.0f} GiB per rollout GPU "
                       f"(headroom {p.gpu_mem_gib - total:.1f} GiB)")
            out += [f"  {x.name:<56} {x.gib:6.2f} GiB  {x.note}" for x in lines]
    out.append(f"routing trace per step ({p.trace_tokens_per_step:,} tokens = batch x n x (prompt+response)):")
    out.append(f"  packed {p.trace_bits_per_token} bits/token = L_moe*k*ceil(log2 E): {fmt_b(p.trace_packed_bytes)}")
    out.append(f"  int16: {fmt_b(p.trace_int16_bytes)}")
    if p.problems:
        out.append("DOES NOT FIT:")
        out += [f"  - {x}" for x in p.problems]
    else:
        out.append("fits")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment")
    ap.add_argument("--arm")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. actor_rollout_ref.rollout.tensor_model_parallel_size=8")
    args = ap.parse_args(argv)
    # verl's modules take seconds to import: after the arguments, so --help answers at once
    print(f"[plan] composing {args.experiment} against verl's config...", file=sys.stderr, flush=True)
    from moerl.verl_ext.compose import ExperimentError, compose_experiment, load_experiment
    from moerl.verl_ext.launch import gpu_hours, layout_from_cfg

    try:
        exp = load_experiment(args.experiment, args.arm)
        cfg = compose_experiment(exp, args.overrides)
        mcfg = planner.load_public_config(exp.moerl["model"])
        lay = layout_from_cfg(cfg, exp.moerl)
        p = planner.plan(mcfg, lay)
    except (ExperimentError, planner.PlanError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report(p, lay, mcfg))
    print(gpu_hours(exp, cfg))
    return 1 if p.problems else 0


if __name__ == "__main__":
    sys.exit(main())
