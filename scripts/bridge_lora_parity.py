"""One LoRA update of Megatron-Bridge's adapter against the embedded trainer's (PEFT) on the same batch
and weights: initialisation, scaling, gradients and the updated factors. Exit 1 naming each difference.

    python scripts/bridge_lora_parity.py [--hidden 7168 --out 4096 --rank 32 --alpha 64] [--a-init xavier]

Why: Megatron-Bridge issue #3274 reports LoRA GRPO below FSDP2's accuracy on identical settings, with
occasional collapse, and is open; nothing else here would notice a Bridge adapter that trains differently
from the PEFT adapter the CPU lab (experiments 00, 05-07) uses. Bridge's path: ``LoRA.transform``
(megatron-bridge 0.6.2 peft/lora.py:117-200) wraps a megatron-core ColumnParallelLinear in ``LoRALinear``
with a ``ParallelLinearAdapter`` (peft/utils.py:896-1240): A is ``linear_in``, B ``linear_out``, scale
alpha/dim, A initialised by ``lora_A_init_method`` (utils.py:1157-1178: "xavier" = xavier_normal_, verl's
default, trainer/config/model/hf_model.yaml; "kaiming" = kaiming_uniform(a=sqrt(5)), PEFT's default).

What is compared (fp32, world size 1, TP=1):
- ``init``: B is zero on both sides, and A's standard deviation agrees within 10 % (a registered band);
- ``scaling``: Bridge's alpha/dim equals PEFT's scaling for the same rank and alpha;
- ``forward`` / ``grad_A`` / ``grad_B`` / ``sgd_update``: with A and B copied from Bridge into PEFT (B made
  non-zero so the A gradient is not trivially zero), the outputs, both factors' gradients of one MSE loss,
  and the factors after one SGD step agree to 1e-5 relative.

Needs megatron-core and megatron-bridge (the cluster image); runs on one GPU, or on a CPU where both import.
The comparison itself (``compare``) runs on the CPU in tests/test_bridge_lora_parity.py against a stand-in
adapter; Bridge's side has not been run here.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
from dataclasses import asdict, dataclass

import torch

INIT_STD_BAND = 0.10
REL_TOL = 1e-5


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def peft_reference(weight: torch.Tensor, rank: int, alpha: float, seed: int = 0):
    """The embedded trainer's adapter: PEFT LoRA on an nn.Linear holding ``weight`` (moerl.lora.peft_lora)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    model = get_peft_model(torch.nn.Sequential(lin), LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                                  target_modules=["0"], bias="none"))
    layer = model.base_model.model[0]
    return layer, layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compare(bridge_forward, bridge_a: torch.nn.Parameter, bridge_b: torch.nn.Parameter, bridge_scale: float,
            weight: torch.Tensor, rank: int, alpha: float, lr: float = 1e-2, seed: int = 0) -> list[Check]:
    """Bridge's adapter (``bridge_forward(x) -> y``, factors A [r, in], B [out, r]) against PEFT's."""
    checks = []
    ref, ref_a, ref_b, ref_scale = peft_reference(weight.detach().cpu().float(), rank, alpha, seed)
    a_std, p_std = float(bridge_a.detach().float().std()), float(ref_a.detach().float().std())
    b_zero = bool((bridge_b.detach() == 0).all()) and bool((ref_b.detach() == 0).all())
    ratio = a_std / p_std
    checks.append(Check("init", b_zero and abs(ratio - 1) <= INIT_STD_BAND,
                        f"B zero on both sides: {b_zero}; std(A) Bridge {a_std:.4g} vs PEFT {p_std:.4g} (ratio "
                        f"{ratio:.3f}, band +-{INIT_STD_BAND:.0%}): a larger A scales B's gradient and every "
                        f"update by the same factor"))
    checks.append(Check("scaling", math.isclose(bridge_scale, ref_scale, rel_tol=1e-12),
                        f"alpha/dim Bridge {bridge_scale:g} vs PEFT scaling {ref_scale:g}"))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # same factors on both sides; B non-zero so grad A is not trivially zero
        bridge_b.copy_(torch.randn(bridge_b.shape, generator=gen).to(bridge_b) * 0.02)
        ref_a.copy_(bridge_a.detach().cpu().float())
        ref_b.copy_(bridge_b.detach().cpu().float())
    x = torch.randn(16, weight.shape[1], generator=gen)
    target = torch.randn(16, weight.shape[0], generator=gen)
    dev = bridge_a.device
    y_bridge = bridge_forward(x.to(dev)).float()
    y_ref = ref(x)
    checks.append(Check("forward", _rel(y_bridge.cpu(), y_ref) <= REL_TOL,
                        f"max rel diff {_rel(y_bridge.cpu(), y_ref):.2e}"))
    torch.nn.functional.mse_loss(y_bridge, target.to(dev)).backward()
    torch.nn.functional.mse_loss(y_ref, target).backward()
    for name, got, want in (("grad_A", bridge_a, ref_a), ("grad_B", bridge_b, ref_b)):
        g = getattr(got, "main_grad", None)
        g = got.grad if g is None else g
        if g is None:
            checks.append(Check(name, False, "Bridge's factor has no gradient"))
            continue
        d = _rel(g.detach().cpu().float(), want.grad)
        checks.append(Check(name, d <= REL_TOL, f"max rel diff {d:.2e}"))
    with torch.no_grad():
        for got, want in ((bridge_a, ref_a), (bridge_b, ref_b)):
            g = getattr(got, "main_grad", None)
            got -= lr * (got.grad if g is None else g).to(got)
            want -= lr * want.grad
    d = max(_rel(bridge_a.detach().cpu().float(), ref_a.detach()), _rel(bridge_b.detach().cpu().float(), ref_b.detach()))
    checks.append(Check("sgd_update", d <= REL_TOL, f"factors after one SGD step (lr {lr}): max rel diff {d:.2e}"))
    return checks


def bridge_adapter(hidden: int, out: int, rank: int, alpha: float, a_init: str, device: torch.device):
    """megatron-core ColumnParallelLinear (TP=1) wrapped by Megatron-Bridge's LoRA.transform, as verl builds
    the actor's adapters (verl/workers/config/megatron_peft.py -> megatron.bridge.peft.utils.create_peft)."""
    import torch.distributed as dist
    from megatron.bridge.peft.lora import LoRA
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=8, params_dtype=torch.float32,
                            use_cpu_initialization=True, gradient_accumulation_fusion=False)
    base = ColumnParallelLinear(hidden, out, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                gather_output=True).to(device)
    base.weight.requires_grad_(False)
    torch.manual_seed(0)
    wrapped = LoRA(target_modules=["linear_fc1"], dim=rank, alpha=alpha, dropout=0.0,
                   lora_A_init_method=a_init).transform(base, name="linear_fc1", prefix="decoder.layers.0.mlp")
    ad = wrapped.adapter
    return (lambda x: wrapped(x)[0]), ad.linear_in.weight, ad.linear_out.weight, ad.alpha / ad.dim, base.weight


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=7168, help="input features (Kimi-K2's hidden size)")
    ap.add_argument("--out", type=int, default=4096, help="output features (Kimi-K2 expert fc1: 2 x 2048)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=64)
    ap.add_argument("--a-init", default="xavier", help="Bridge's lora_A_init_method (verl's default: xavier)")
    ap.add_argument("--json", help="also write the checks here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        fwd, a, b, scale, weight = bridge_adapter(args.hidden, args.out, args.rank, args.alpha, args.a_init, device)
    except ImportError as err:
        print(f"error: {err}: needs megatron-core and megatron-bridge (the cluster image, requirements/gpu.txt)",
              file=sys.stderr)
        return 2
    checks = compare(fwd, a, b, scale, weight, args.rank, args.alpha)
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'} [{c.name}] {c.detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": str(device), "checks": [asdict(c) for c in checks]}, f, indent=1)
    failed = [c.name for c in checks if not c.ok]
    print("Bridge's LoRA update matches PEFT's" if not failed else f"{len(failed)} difference(s): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
