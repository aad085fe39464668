"""A user's checkpoint from a local directory (``model.path``): config, safetensors weights, tokenizer, chat template.

Everything about the directory is checked before a weight is read, each problem in one line naming the file
and the fix: a hub id (nothing is downloaded at run time), no config.json, a family outside
moerl.models.families, a quantized checkpoint the trainer cannot run, weights only as pickle files (loading
them could run code), no tokenizer, no EOS, no chat template, a tokenizer larger than the model's vocabulary.
The model is always built from transformers' own class for its ``model_type`` (never the checkpoint's Python,
whatever ``trust_remote_code`` says): its routers are then the ones moerl.models.routers reads and replays.
``trust_remote_code`` reaches only the tokenizer (Moonlight ships a tiktoken tokenizer as code).
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moerl.config import ConfigError
from moerl.models.families import FAMILIES, Family

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class CheckpointError(ConfigError):
    """A checkpoint directory that cannot be trained here; the message names the file and the fix."""


@dataclass
class CheckpointInfo:
    """What a checkpoint directory holds, read from its small files only (no weight is loaded)."""

    path: Path
    config: dict
    family: Family
    weight_files: list[Path]
    chat_template: str | None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def moe_layers(self) -> list[int]:
        """Global numbers of the decoder layers with routed experts, by the rules of the family's class."""
        c, n = self.config, int(self.config["num_hidden_layers"])
        if self.model_type in ("deepseek_v3", "deepseek_v2"):
            dense, step = int(c.get("first_k_dense_replace", 0)), int(c.get("moe_layer_freq", 1))
            return [i for i in range(n) if i >= dense and i % step == 0]
        if self.model_type in ("qwen3_moe", "qwen2_moe"):
            only, step = set(c.get("mlp_only_layers") or []), int(c.get("decoder_sparse_step", 1))
            return [i for i in range(n) if i not in only and (i + 1) % step == 0]
        return list(range(n))

    def fingerprint(self) -> str:
        """sha256 over config.json, the tokenizer's files and each weight file's name and size: what a run
        records as its base checkpoint (the tensors themselves are hashed by the trainer as they load)."""
        h = hashlib.sha256()
        for name in ("config.json", *TOKENIZER_FILES):
            f = self.path / name
            if f.is_file():
                h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
        for f in self.weight_files:
            h.update(f"{f.name}:{f.stat().st_size}\0".encode())
        return h.hexdigest()[:16]


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not readable JSON ({type(err).__name__}: {err}); expected the {what}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object (the {what})")
    return data


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index, "safetensors index").get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if not shards or missing:
            raise CheckpointError(f"{index}: {'lists no shard' if not shards else f'shard {missing[0]} is missing'} "
                                  f"({len(missing)} of {len(shards)} missing); download the checkpoint completely")
        return [path / s for s in shards]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    if pickles:
        raise CheckpointError(f"{path}: weights only as pickle files ({', '.join(pickles[:3])}); loading a pickle can "
                              f"run code, so moerl reads safetensors only: convert them (e.g. transformers' "
                              f"save_pretrained with safe_serialization) or use the safetensors release")
    raise CheckpointError(f"{path}: no weights (expected model.safetensors, or model.safetensors.index.json and its "
                          f"shards)")


def _chat_template(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        f = path / name
        if f.is_file():
            template = _read_json(f, "tokenizer's config").get("chat_template")
            if isinstance(template, list):  # named templates: the default one
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            if template:
                return template
    return None


def _eos_ids(path: Path) -> list[int]:
    f = path / "generation_config.json"
    if not f.is_file():
        return []
    eos = _read_json(f, "generation config").get("eos_token_id")
    return [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]


def inspect_checkpoint(path: str | Path) -> CheckpointInfo:
    """Check ``path`` is a checkpoint directory moerl can train, from its small files only."""
    given = str(path)
    path = Path(given).expanduser()
    if not path.exists():
        if _HUB_ID.match(given) and not given.startswith("."):
            raise CheckpointError(f"model.path={given}: no such directory, and it looks like a hub id: nothing is "
                                  f"downloaded at run time, download it first (huggingface-cli download {given} "
                                  f"--local-dir DIR) and pass DIR")
        raise CheckpointError(f"model.path={given}: no such directory (expected a checkpoint directory with config.json)")
    if not path.is_dir():
        raise CheckpointError(f"model.path={given}: not a directory (expected a checkpoint directory with config.json)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json, not a Hugging Face checkpoint directory")
    config = _read_json(config_file, "model's config")
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(f"{config_file}: model_type {model_type!r} is not a supported MoE family (supported: "
                              f"{', '.join(FAMILIES)})")
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise CheckpointError(f"{config_file}: quantization_config (quant_method={method}): the trainer runs bf16/fp32 "
                              f"weights and would dequantize them while the rollout ran the quantized format, a "
                              f"mismatch nobody asked for; use the bf16 release (rollout precisions are set by "
                              f"rollout.dtype)")
    for key in ("vocab_size", "num_hidden_layers", "hidden_size"):
        if not isinstance(config.get(key), int):
            raise CheckpointError(f"{config_file}: {key} is missing or not an integer")
    weights = _weight_files(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                               "tiktoken.model")):
        raise CheckpointError(f"{path}: no tokenizer (expected tokenizer.json or tokenizer_config.json beside "
                              f"config.json)")
    return CheckpointInfo(path, config, FAMILIES[model_type], weights, _chat_template(path), _eos_ids(path))


def load_tokenizer(info: CheckpointInfo, trust_remote_code: bool = False, need_chat_template: bool = True):
    """The checkpoint's tokenizer, left-padding, with a pad token (its EOS when it has none)."""
    from transformers import AutoTokenizer

    if need_chat_template and info.chat_template is None:
        raise CheckpointError(f"{info.path}: the tokenizer has no chat template (chat_template.jinja, or "
                              f"'chat_template' in tokenizer_config.json); add one, or render plain prompts with "
                              f"data.chat_template=false (scripts/probe.py: --no-chat-template)")
    try:
        tok = AutoTokenizer.from_pretrained(info.path, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds here; the directory is the cause
        hint = "" if trust_remote_code else "; if the checkpoint ships its tokenizer as code, set model.trust_remote_code=true"
        raise CheckpointError(f"{info.path}: the tokenizer does not load ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:200]}){hint}") from None
    if tok.eos_token_id is None and not info.eos_token_ids:
        raise CheckpointError(f"{info.path}: the tokenizer has no EOS token (tokenizer_config.json eos_token) and "
                              f"generation_config.json names none: a rollout would never end")
    if len(tok) > info.vocab_size:
        raise CheckpointError(f"{info.path}: the tokenizer has {len(tok)} tokens but config.json vocab_size is "
                              f"{info.vocab_size}: ids past the embedding would be sampled; a tokenizer shorter than "
                              f"the vocabulary (padded, as hub checkpoints are) is fine, a longer one is not")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.convert_ids_to_tokens(info.eos_token_ids[0])
    tok.padding_side = "left"
    return tok


def eos_token_ids(info: CheckpointInfo, tokenizer) -> list[int]:
    """Every id that ends a response: generation_config.json's (chat models end turns with their own token)
    and the tokenizer's EOS."""
    ids = list(info.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def resolve_device(device: str) -> torch.device:
    """``auto``: the first GPU when one is visible, else the CPU; ``cuda`` without a GPU is refused."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("device=cuda but torch sees no GPU (torch.cuda.is_available() is False); use "
                              "device=cpu or device=auto")
    return torch.device(device)


def load_model(info: CheckpointInfo, dtype: str = "fp32", device: str | torch.device = "cpu",
               experts_implementation: str | None = None) -> torch.nn.Module:
    """The checkpoint's weights in transformers' own class for its family, in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=DTYPES[dtype], attn_implementation="sdpa", trust_remote_code=False, use_safetensors=True)
    if experts_implementation:
        kwargs["experts_implementation"] = experts_implementation
    device = torch.device(device)
    if device.type != "cpu":
        kwargs["device_map"] = {"": device}
    try:
        model = AutoModelForCausalLM.from_pretrained(info.path, **kwargs)
    except Exception as err:  # noqa: BLE001 - a damaged or mismatched file; name the directory
        raise CheckpointError(f"{info.path}: the weights do not load into transformers' {info.model_type} class "
                              f"({type(err).__name__}: {' '.join(str(err).split())[:240]})") from None
    from moerl.models.routers import find_moe_layers

    numbers = [layer.layer_number for layer in find_moe_layers(model)]
    if numbers != info.moe_layers():
        raise CheckpointError(f"{info.path}: the model's MoE layers {numbers} differ from what config.json says "
                              f"({info.moe_layers()}); R3 would replay routes into the wrong layers")
    return model.eval()


def model_shape(config: dict, lora_cfg) -> "ModelShape":
    """Exact parameter and LoRA counts of a checkpoint's config, from transformers' own class built on the meta
    device (no weight is allocated or read): the inputs of the one-device memory plan."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moerl.models.families import family
    from moerl.planner import ModelShape

    fam = family(config["model_type"])
    hf = AutoConfig.for_model(**{k: v for k, v in config.items() if not k.startswith("_")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    params = sum(p.numel() for p in model.parameters())
    lora = 0
    attention = set(fam.attention) if lora_cfg.target_attention else set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in attention and isinstance(module, torch.nn.Linear):
            lora += lora_cfg.rank * (module.in_features + module.out_features)
    if lora_cfg.target_experts:
        for name, p in model.named_parameters():
            if p.dim() == 3 and any(name.endswith(t) for t in fam.experts):
                experts, out_f, in_f = p.shape
                lora += experts * lora_cfg.rank * (in_f + out_f)
    n, heads = hf.num_hidden_layers, hf.num_attention_heads
    if config["model_type"] in ("deepseek_v3", "deepseek_v2"):  # transformers caches MLA's full keys and values
        kv = n * heads * (hf.qk_nope_head_dim + hf.qk_rope_head_dim + hf.v_head_dim)
    else:
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        kv = n * 2 * getattr(hf, "num_key_value_heads", heads) * head_dim
    return ModelShape(params=params, lora_params=lora, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                      num_layers=n, kv_values_per_token=kv)


def device_memory_gib(device: torch.device) -> tuple[float, str]:
    """(memory in GiB, a name) of ``device``: a GPU's total memory, or the machine's RAM for the CPU."""
    import os

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory / 1024**3, props.name
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, "cpu (RAM)"


def memory_plan(cfg, config: dict | None = None, device_gib: float | None = None):
    """The one-device plan of an experiment config with ``model.path`` (its config.json, or ``config``), on
    the device it will run on (or a device of ``device_gib`` GiB: plan for a GPU from another machine)."""
    from moerl.planner import plan_one_device

    if config is None:
        config = _read_json(Path(cfg.model.path) / "config.json", "model's config")
    device = resolve_device(cfg.device) if device_gib is None else None
    gib, name = device_memory_gib(device) if device is not None else (device_gib, f"a {device_gib:g} GiB device")
    return plan_one_device(model_shape(config, cfg.lora), trainer_dtype=cfg.trainer.dtype,
                           rollout_sequences=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
                           sequence_tokens=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
                           micro_batch=cfg.trainer.micro_batch_size,
                           activation_checkpointing=cfg.trainer.activation_checkpointing,
                           device_gib=gib, device_name=name)
