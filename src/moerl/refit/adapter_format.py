"""One adapter, three spellings: the model's own parameters, the canonical refit layout, and HF/PEFT
per-expert files (what vLLM's ``add_lora`` loads).

Canonical names are the plain module/parameter name plus ``.lora_A`` / ``.lora_B``:
- dense linear ``model.layers.0.self_attn.q_proj.lora_A`` ``[r, in]`` and ``.lora_B`` ``[out, r]``;
- fused experts ``model.layers.0.mlp.experts.gate_up_proj.lora_A`` ``[E|1, r, in]`` and ``.lora_B``
  ``[E|1, out, r]`` (1 = shared by all experts; see moerl.lora.expert_modes).
Refit sends canonical tensors, so PEFT's interleaved per-expert layout never leaks into the wire
format and the sharding rules of moerl.lora.sharding apply by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from moerl.lora.expert_modes import ExpertLoRADelta, peft_expert_factors
from moerl.refit.weights import plain_name


class AdapterMismatchError(ValueError):
    """An adapter that does not fit a model; the message names the first offending tensor."""


@dataclass
class _Entry:
    shape: tuple[int, ...]
    get: Callable[[], torch.Tensor]
    set: Callable[[torch.Tensor], None]


class AdapterMap:
    """Canonical adapter name -> read/write access into one model's LoRA parameters (built once)."""

    def __init__(self, model: nn.Module, adapter: str = "default"):
        from peft.tuners.lora.layer import LoraLayer, ParamWrapper

        self.entries: dict[str, _Entry] = {}
        self.scales: dict[str, float] = {}
        for mname, module in model.named_modules():
            if isinstance(module, LoraLayer) and adapter in getattr(module, "lora_A", {}):
                a_w = module.lora_A[adapter].weight
                b_w = module.lora_B[adapter].weight
                scale = float(module.scaling[adapter])
                if isinstance(module, ParamWrapper) and module.num_experts > 1:
                    key = plain_name(f"{mname}.{module.parameter_name}")
                    self._add_peft_experts(key, a_w, b_w, module.num_experts, scale)
                else:
                    key = plain_name(f"{mname}.weight").removesuffix(".weight")
                    self._add_param(f"{key}.lora_A", a_w)
                    self._add_param(f"{key}.lora_B", b_w)
                    self.scales[key] = scale
            plist = getattr(module, "parametrizations", None)
            if plist is not None:
                for pname in plist.keys():
                    for p in plist[pname]:
                        if isinstance(p, ExpertLoRADelta):
                            key = plain_name(f"{mname}.{pname}")
                            self._add_param(f"{key}.lora_A", p.lora_A)
                            self._add_param(f"{key}.lora_B", p.lora_B)
                            self.scales[key] = p.scale
        if not self.entries:
            raise AdapterMismatchError(f"{type(model).__name__}: the model has no LoRA adapter '{adapter}'")

    def _add_param(self, name: str, param: torch.Tensor) -> None:
        def setter(t, param=param):
            param.data.copy_(t)

        self.entries[name] = _Entry(tuple(param.shape), lambda param=param: param.detach(), setter)

    def _add_peft_experts(self, key: str, a_w, b_w, num_experts: int, scale: float) -> None:
        a_shape = (num_experts, a_w.shape[0] // num_experts, a_w.shape[1])
        b_shape = (num_experts, b_w.shape[0], b_w.shape[1] // num_experts)

        def set_a(t, a_w=a_w):
            a_w.data.copy_(t.reshape(a_w.shape))

        def set_b(t, b_w=b_w):  # one reordering copy into PEFT's [out, r, E] memory order
            b_w.data.view(b_w.shape[0], -1, num_experts).copy_(t.permute(1, 2, 0))

        self.entries[f"{key}.lora_A"] = _Entry(a_shape, lambda: peft_expert_factors(a_w, b_w, num_experts)[0].detach(), set_a)
        self.entries[f"{key}.lora_B"] = _Entry(b_shape, lambda: peft_expert_factors(a_w, b_w, num_experts)[1].detach(), set_b)
        self.scales[key] = scale

    # -- API -----------------------------------------------------------------------------------
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: e.shape for k, e in self.entries.items()}

    def state(self) -> dict[str, torch.Tensor]:
        """Canonical adapter tensors (views where the layout allows; do not mutate)."""
        return {k: e.get() for k, e in self.entries.items()}

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise naming the first tensor whose name, rank or shape does not fit this model."""
        for name in sorted(tensors):
            if name not in self.entries:
                raise AdapterMismatchError(f"adapter tensor '{name}': the engine's model has no such LoRA "
                                           f"tensor (e.g. {next(iter(self.entries))})")
            want, got = self.entries[name].shape, tuple(tensors[name].shape)
            if want != got:
                rank_dim = -2 if name.endswith("lora_A") else -1
                what = ("rank" if want[rank_dim] != got[rank_dim] and len(want) == len(got) else "shape")
                raise AdapterMismatchError(f"adapter tensor '{name}': {what} mismatch, got {got}, "
                                           f"the engine's model expects {want}")
        missing = sorted(set(self.entries) - set(tensors))
        if missing:
            raise AdapterMismatchError(f"adapter tensor '{missing[0]}': missing ({len(missing)} missing in all)")

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Validate everything first, then copy: a bad adapter leaves the model untouched."""
        self.check(tensors)
        for name, t in tensors.items():
            self.entries[name].set(t)


def canonical_adapter(model: nn.Module) -> dict[str, torch.Tensor]:
    return AdapterMap(model).state()


# ---- HF/PEFT per-expert files (vLLM add_lora) -------------------------------------------------

# Per-expert sub-linear names of the fused tensors, per family: (gate, up, down).
EXPERT_LINEARS = {
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
    "olmoe": ("gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "deepseek_v2": ("gate_proj", "up_proj", "down_proj"),
}
HF_PREFIX = "base_model.model."


def _family(preset: str) -> tuple[str, str, str]:
    if preset not in EXPERT_LINEARS:
        raise ValueError(f"adapter export: unknown preset '{preset}' (have: {list(EXPERT_LINEARS)})")
    return EXPERT_LINEARS[preset]


def to_hf_peft(canonical: dict[str, torch.Tensor], preset: str, num_experts: int) -> dict[str, torch.Tensor]:
    """Canonical -> PEFT per-expert tensors ``base_model.model.<...>.experts.{e}.gate_proj.lora_A.weight``.

    As Megatron-Bridge's export: the fused gate_up A is duplicated onto gate and up, its B split in
    halves; a shared factor is replicated under every expert's name (``expand_shared_outer``)."""
    gate, up, down = _family(preset)
    out: dict[str, torch.Tensor] = {}
    for name, t in canonical.items():
        base, factor = name.rsplit(".", 1)
        if ".experts." not in f".{base}":
            out[f"{HF_PREFIX}{base}.{factor}.weight"] = t.contiguous()
            continue
        module, fused = base.rsplit(".", 1)  # ...mlp.experts, gate_up_proj | down_proj
        t = t.expand(num_experts, *t.shape[1:]) if t.shape[0] == 1 else t
        if t.shape[0] != num_experts:
            raise AdapterMismatchError(f"adapter tensor '{name}': {t.shape[0]} experts, expected {num_experts}")
        for e in range(num_experts):
            if fused == "gate_up_proj":
                if factor == "lora_A":
                    out[f"{HF_PREFIX}{module}.{e}.{gate}.lora_A.weight"] = t[e].clone()
                    out[f"{HF_PREFIX}{module}.{e}.{up}.lora_A.weight"] = t[e].clone()
                else:
                    g, u = t[e].chunk(2, dim=0)
                    out[f"{HF_PREFIX}{module}.{e}.{gate}.lora_B.weight"] = g.clone()
                    out[f"{HF_PREFIX}{module}.{e}.{up}.lora_B.weight"] = u.clone()
            elif fused == "down_proj":
                out[f"{HF_PREFIX}{module}.{e}.{down}.{factor}.weight"] = t[e].clone()
            else:
                raise AdapterMismatchError(f"adapter tensor '{name}': unknown fused expert tensor '{fused}'")
    return out


def from_hf_peft(tensors: dict[str, torch.Tensor], preset: str, expert_mode: str) -> dict[str, torch.Tensor]:
    """PEFT per-expert tensors -> canonical (the inverse of ``to_hf_peft`` for ``expert_mode``).

    Fails naming the tensor when gate and up A differ (not representable in the fused rank-r layout)
    or when a factor the mode shares differs across experts."""
    from moerl.lora.expert_modes import sharing

    gate, up, down = _family(preset)
    dense: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if not name.startswith(HF_PREFIX) or not name.endswith(".weight"):
            raise AdapterMismatchError(f"adapter tensor '{name}': expected '{HF_PREFIX}<module>.lora_A|B.weight'")
        body = name[len(HF_PREFIX):-len(".weight")]
        base, factor = body.rsplit(".", 1)
        parts = base.split(".")
        if len(parts) >= 3 and parts[-3] == "experts" and parts[-2].isdigit():
            module = ".".join(parts[:-2])
            experts.setdefault((module, parts[-1], factor), {})[int(parts[-2])] = t
        else:
            dense[f"{base}.{factor}"] = t
    out = dict(dense)
    modules = sorted({m for (m, _, _) in experts})
    for module in modules:
        def stack(linear, factor):
            got = experts.get((module, linear, factor))
            if not got:
                raise AdapterMismatchError(f"adapter: '{module}.*.{linear}.{factor}' missing")
            n = len(got)
            if sorted(got) != list(range(n)):
                raise AdapterMismatchError(f"adapter: '{module}.{{e}}.{linear}.{factor}' has experts {sorted(got)}")
            return torch.stack([got[e] for e in range(n)])

        a_g, a_u = stack(gate, "lora_A"), stack(up, "lora_A")
        if not torch.equal(a_g, a_u):
            raise AdapterMismatchError(f"adapter tensor '{HF_PREFIX}{module}.0.{up}.lora_A.weight': gate and up "
                                       f"A differ, cannot fuse into {module}.gate_up_proj")
        fused = {
            "gate_up_proj": (a_g, torch.cat([stack(gate, "lora_B"), stack(up, "lora_B")], dim=1)),
            "down_proj": (stack(down, "lora_A"), stack(down, "lora_B")),
        }
        for pname, (a, b) in fused.items():
            share_a, share_b = sharing(expert_mode, pname)
            for factor, t, shared in (("lora_A", a, share_a), ("lora_B", b, share_b)):
                if shared:
                    if not all(torch.equal(t[0], t[e]) for e in range(1, t.shape[0])):
                        raise AdapterMismatchError(f"adapter '{module}.{pname}.{factor}': expert_mode={expert_mode} "
                                                   f"shares it but the experts' copies differ")
                    t = t[:1]
                out[f"{module}.{pname}.{factor}"] = t.contiguous()
    return out


def adapter_config(preset: str, rank: int, alpha: float, canonical_names, base_model: str = "") -> dict:
    """PEFT ``adapter_config.json`` for the per-expert export (vLLM reads r, lora_alpha, target_modules)."""
    gate, up, down = _family(preset)
    targets = set()
    for name in canonical_names:
        base = name.rsplit(".", 1)[0]
        leaf = base.rsplit(".", 1)[1]
        targets.update((gate, up, down) if leaf in ("gate_up_proj", "down_proj") else (leaf,))
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
            "bias": "none", "target_modules": sorted(targets), "base_model_name_or_path": base_model,
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None}


def save_hf_adapter(path: str | Path, canonical: dict[str, torch.Tensor], preset: str, num_experts: int,
                    rank: int, alpha: float, base_model: str = "") -> Path:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (a vLLM/PEFT adapter directory)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(to_hf_peft(canonical, preset, num_experts), str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(adapter_config(preset, rank, alpha, canonical, base_model),
                                                         indent=1))
    return path


def load_hf_adapter(path: str | Path, preset: str, expert_mode: str) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    path = Path(path)
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        if not (path / f).exists():
            raise AdapterMismatchError(f"{path}: no {f} (expected a PEFT adapter directory)")
    config = json.loads((path / "adapter_config.json").read_text())
    return from_hf_peft(load_file(str(path / "adapter_model.safetensors")), preset, expert_mode), config
