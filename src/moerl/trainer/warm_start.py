"""Warm start: supervised pre-training of the tiny MoE on the task, cached by a content hash.

GRPO from a random init would see reward 0 for every sample (no signal); starting from a policy
with 20-60 % pass@1 gives groups with mixed rewards. The checkpoint is keyed by a hash of
(model config, data config, warm-start config), so any change to them retrains, and the
committed checkpoint is reused when nothing changed. Regenerate with
``python scripts/warm_start.py experiments/00_tiny_moe_cpu/base.yaml``.

A relative ``warm_start.cache_dir`` is taken from the repository root, so every working directory finds
the same cache. What a run was trained on is the content of its base weights (``weights_hash``), which
run.json and every checkpoint record: a resume on other base weights is refused, whatever their path.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import time
from pathlib import Path

import torch
import xxhash
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from moerl.config import WARM_START_PCT_START, ExperimentConfig, to_dict, without_checkpoint_keys
from moerl.data import load_splits
from moerl.data.prompts import render_prompt, render_target
from moerl.data.tokenizer import BOS, EOS, build_tokenizer
from moerl.identity import inputs_record
from moerl.models.experts import implementation
from moerl.models.presets import build_model
from moerl.trainer.state_files import StateFileError, load_state, save_state, unpickle_legacy_state

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]


def warm_start_key(cfg: ExperimentConfig) -> str:
    """``<preset>-<hash of the model, data and warm-start config>``; with data files, their content too
    (a training file edited in place trains another warm start)."""
    ws = to_dict(cfg.warm_start)
    ws.pop("cache_dir")
    # a checkpoint's keys are never read by a warm start (model.path has none)
    model, data = (without_checkpoint_keys(name, to_dict(section)) for name, section in (("model", cfg.model),
                                                                                          ("data", cfg.data)))
    keyed = {"model": model, "data": data, "warm_start": ws}
    data_content = {k: v for k, v in inputs_record(cfg).items() if k.startswith("data.")}
    if data_content:  # only with data files: the keys of warm starts of generated data stay as they were
        keyed["data_content"] = data_content
    blob = json.dumps(keyed, sort_keys=True)
    return f"{cfg.model.preset}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def warm_start_dir(cfg: ExperimentConfig) -> Path:
    """``<cache_dir>/<key>``; a relative cache_dir is taken from the repository root, not the working directory."""
    root = Path(cfg.warm_start.cache_dir).expanduser()
    return (root if root.is_absolute() else REPO / root) / warm_start_key(cfg)


def weights_hash(model: torch.nn.Module) -> str:
    """xxh3-64 of a model's weights (every state_dict entry's name, dtype, shape and bytes, in name order):
    the identity of the base a LoRA is trained on, whatever file or directory it came from."""
    h = xxhash.xxh3_64()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sft_batch(rows: list[dict], tokenizer, task: str):
    prompts = [BOS + render_prompt(task, r["question"]) for r in rows]
    targets = [render_target(r["answer"], r.get("target")) + EOS for r in rows]
    p_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    t_ids = [tokenizer(t, add_special_tokens=False).input_ids for t in targets]
    length = max(len(p) + len(t) for p, t in zip(p_ids, t_ids))
    ids = torch.full((len(rows), length), tokenizer.pad_token_id)
    labels = torch.full((len(rows), length), -100)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (p, t) in enumerate(zip(p_ids, t_ids)):
        seq = p + t
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p): len(seq)] = torch.tensor(t)  # loss on the answer only
        mask[i, : len(seq)] = 1
    return ids, mask, labels


# A long SFT (experiment 06's wide geometries take hours on one thread) saves its progress this often, so a
# killed session continues where it stopped instead of starting over; how often is not part of the result.
PROGRESS_EVERY_SECONDS = 600.0


def _progress_path(out_dir: Path) -> Path:
    """A safetensors state file (``moerl.trainer.state_files``): reading it runs no code."""
    return out_dir.with_name(out_dir.name + ".progress.safetensors")


def _legacy_progress_path(out_dir_or_progress: Path) -> Path:
    """Where versions that pickled the SFT progress saved it."""
    p = Path(out_dir_or_progress)
    stem = p.name.removesuffix(".progress.safetensors")
    return p.with_name(stem + ".progress.pt")


def _save_progress(path: Path, key: str, step: int, seconds: float, model, opt, sched, rng: random.Random) -> None:
    """Everything the next step depends on (weights, AdamW and schedule state, the sampler's and torch's
    random state), written atomically: a kill mid-write leaves the previous file."""
    state = {"key": key, "step": step, "seconds": seconds, "model": model.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict(), "rng": rng.getstate(), "torch_rng": torch.get_rng_state()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_state(tmp, state)
    tmp.replace(path)
    _legacy_progress_path(path).unlink(missing_ok=True)  # superseded


def _read_progress(path: Path) -> dict | None:
    """The saved SFT progress at ``path``, else at its legacy ``.progress.pt`` (read by the restricted
    unpickler); None when there is none or it cannot be read (a warning names it: the SFT starts over)."""
    legacy = _legacy_progress_path(path)
    source = path if path.exists() or not legacy.exists() else legacy
    if not source.exists():
        return None
    try:
        state = load_state(source) if source == path else unpickle_legacy_state(source)
        if not isinstance(state, dict):
            raise StateFileError(f"{source}: expected a dict of SFT progress, got {type(state).__name__}")
    except StateFileError as err:
        log.warning("%s; not used: training from step 0", err)
        return None
    return state


def _load_progress(path: Path, key: str, steps: int, model, opt, sched, rng: random.Random) -> tuple[int, float]:
    """(steps done, seconds spent) of a saved SFT of the same key, restored into the given objects; (0, 0.0)
    when there is none. A file of another key (the config changed) is not used."""
    state = _read_progress(path)
    if state is None:
        return 0, 0.0
    if state.get("key") != key or not 0 < state.get("step", 0) < steps:
        log.warning("%s: saved SFT progress of another configuration (%s, step %s), not used; training from step 0",
                    path, state.get("key"), state.get("step"))
        return 0, 0.0
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    rng.setstate(state["rng"])
    torch.set_rng_state(state["torch_rng"])
    log.info("warm start: continuing the SFT saved at step %d of %d (%s)", state["step"], steps, path)
    return state["step"], state["seconds"]


def sft_step(model, opt, sched, ids, mask, labels) -> torch.Tensor:
    """One supervised step (loss on the answer tokens, gradient clipped to norm 1); returns the loss."""
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss


def sft_optimizer(model, cfg: ExperimentConfig):
    """The warm start's AdamW and its one-cycle schedule over ``cfg.warm_start.steps``."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warm_start.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.warm_start.lr, total_steps=cfg.warm_start.steps,
                                                pct_start=WARM_START_PCT_START)
    return opt, sched


def supervised_warm_start(cfg: ExperimentConfig, progress: bool = True, device: str | torch.device = "cpu",
                          progress_file: Path | None = None, log_every_s: float | None = None,
                          init_seed: int | None = None):
    """(trained fp32 model, tokenizer, meta): the warm start's SFT from random init and its evaluation by the
    rollout engine, on ``device``, nothing written but ``progress_file``. With it, progress is saved there every
    ``PROGRESS_EVERY_SECONDS`` and a saved SFT of the same key is continued (``train_warm_start``, which saves
    the result to the cache); a caller on a borrowed GPU passes none and keeps the model in memory, and
    ``log_every_s`` so that a run cut off by its time limit still shows how far the SFT got. ``init_seed``
    (default: the config's data seed) seeds the initial weights and the batch order only, the data split
    staying the config's: another SFT of the same data, for the spread between SFTs. Saved progress is keyed
    by the config alone, so the two are not combined."""
    from tqdm import tqdm

    from moerl import faults

    if init_seed is not None and progress_file is not None:
        raise ValueError("supervised_warm_start: init_seed with a progress_file (saved SFT progress is keyed by "
                         "the config alone); pass one or the other")
    seed = cfg.data.seed if init_seed is None else init_seed
    device = torch.device(device)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    train_rows, test_rows = load_splits(cfg.data)
    model = build_model(cfg.model, tokenizer, seed=seed, device=device)
    model.config.output_router_logits = True  # adds the load-balancing aux loss during SFT
    opt, sched = sft_optimizer(model, cfg)
    steps = cfg.warm_start.steps
    rng = random.Random(seed)
    key = warm_start_key(cfg)
    done, earlier = (0, 0.0) if progress_file is None else _load_progress(progress_file, key, steps, model, opt,
                                                                         sched, rng)
    start = last_save = last_log = time.time()
    bar = tqdm(range(done, steps), initial=done, total=steps, desc="warm start (SFT)", disable=not progress)
    for step in bar:
        batch = sft_batch(rng.sample(train_rows, cfg.warm_start.batch_size), tokenizer, cfg.data.task)
        loss = sft_step(model, opt, sched, *(t.to(device) for t in batch))
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if progress_file is not None and step + 1 < steps and time.time() - last_save >= PROGRESS_EVERY_SECONDS:
            _save_progress(progress_file, key, step + 1, earlier + time.time() - start, model, opt, sched, rng)
            last_save = time.time()
            faults.hit("warm_start_progress")
            if not progress:  # no bar (a log file, a sweep): the saves are the progress a reader sees
                rate = (last_save - start) / (step + 1 - done)
                log.info("warm start: step %d of %d saved, loss %.3f, about %.0f min to go", step + 1, steps,
                         loss.item(), rate * (steps - step - 1) / 60)
        if log_every_s is not None and not progress and time.time() - last_log >= log_every_s:
            last_log = time.time()
            rate = (last_log - start) / (step + 1 - done)
            log.info("warm start: step %d of %d, loss %.3f, %.3f s a step, about %.0f s to go", step + 1, steps,
                     loss.item(), rate, rate * (steps - step - 1))
    model.config.output_router_logits = False
    seconds = earlier + time.time() - start
    del opt, sched  # the optimiser state (twice the weights) is not needed to evaluate
    model.zero_grad(set_to_none=True)

    from moerl.rollout.hf import HFEngine  # evaluation by the rollout engine, as in GRPO

    if log_every_s is not None:
        log.info("warm start: %d steps in %.0f s; evaluating on %d held-out prompts", steps, seconds, len(test_rows))
    accuracy = evaluate_policy(HFEngine(model, tokenizer, cfg.rollout, cfg.data.task), test_rows, seed=cfg.data.seed)
    meta = {"key": key, "train_seconds": round(seconds, 1), "steps": steps,
            "test_accuracy": accuracy, "rollout_dtype": cfg.rollout.dtype,
            "command": "python scripts/warm_start.py <experiment config>",
            "config": {"model": to_dict(cfg.model), "data": to_dict(cfg.data), "warm_start": to_dict(cfg.warm_start)}}
    if device.type != "cpu":
        meta["device"] = str(device)
    if init_seed is not None:
        meta["init_seed"] = init_seed
    return model, tokenizer, meta


def train_warm_start(cfg: ExperimentConfig, out_dir: Path, progress: bool = True) -> dict:
    """Train from random init and save model + tokenizer + meta.json to ``out_dir`` (atomically). Progress
    is saved every ``PROGRESS_EVERY_SECONDS`` beside ``out_dir`` and continued after a kill: the result is
    the same, bit for bit, as an uninterrupted SFT's."""
    saved = _progress_path(out_dir)
    model, tokenizer, meta = supervised_warm_start(cfg, progress=progress, progress_file=saved)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    saved.unlink(missing_ok=True)
    _legacy_progress_path(saved).unlink(missing_ok=True)
    log.info("warm start saved to %s: %s", out_dir, meta["test_accuracy"])
    return meta


def evaluate_policy(engine, rows: list[dict], seed: int, batch: int = 256, samples: int = 1) -> dict:
    """pass@1 at the engine's temperature, averaged over ``samples`` completions per problem, and greedy
    accuracy (one completion per problem) on ``rows``."""
    from moerl.reward import batch_rewards

    out = {}
    for name, greedy in (("pass1", False), ("greedy", True)):
        per_problem = 1 if greedy else samples
        chunk_rows = max(1, batch // per_problem)
        correct = 0.0
        for i in range(0, len(rows), chunk_rows):
            chunk = rows[i: i + chunk_rows]
            rb = engine.generate([r["question"] for r in chunk], [r["answer"] for r in chunk], per_problem,
                                 greedy=greedy, seed=seed + i)
            prompts = getattr(engine, "prompts", None)
            correct += sum(batch_rewards(rb.texts, rb.answers, bool(prompts and prompts.answers_after_hashes)))
        out[name] = correct / max(len(rows) * per_problem, 1)
    return out


def load_warm_start(cfg: ExperimentConfig, train_if_missing: bool = True, progress: bool = True):
    """(fp32 model, tokenizer, meta) from the cache, training it first if absent."""
    path = warm_start_dir(cfg)
    if not cfg.warm_start.enabled:
        tokenizer = build_tokenizer()
        return build_model(cfg.model, tokenizer, seed=cfg.data.seed), tokenizer, {"test_accuracy": None}
    if not (path / "meta.json").exists():
        if not train_if_missing:
            raise FileNotFoundError(f"no warm start at {path}; run python scripts/warm_start.py <config>")
        log.info("no cached warm start at %s: training it (%d steps)", path, cfg.warm_start.steps)
        train_warm_start(cfg, path, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32,
                                                 experts_implementation=implementation(cfg.model.experts_implementation))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    return model.float(), tokenizer, json.loads((path / "meta.json").read_text())


def load_base(cfg: ExperimentConfig, progress: bool = True):
    """(base model, tokenizer, meta, prompt format): the checkpoint at ``model.path`` on ``device`` in
    ``trainer.dtype``, or the tiny preset's warm start (trained first if absent) on the CPU."""
    from moerl.data.prompts import PromptFormat

    if not cfg.model.path:
        model, tokenizer, meta = load_warm_start(cfg, progress=progress)
        return model, tokenizer, meta, PromptFormat(cfg.data.task)
    from moerl.models.pretrained import (eos_token_ids, inspect_checkpoint, load_model, load_tokenizer,
                                         resolve_device)

    info = inspect_checkpoint(cfg.model.path)
    tokenizer = load_tokenizer(info, cfg.model.trust_remote_code, need_chat_template=cfg.data.chat_template)
    device = resolve_device(cfg.device)
    from moerl.models.pretrained import CheckpointError, memory_plan
    from moerl.planner import one_device_report

    plan = memory_plan(cfg, info.config)  # before a weight is read
    log.info("%s", one_device_report(plan))
    if device.type == "cuda" and plan.margin_gib < 0:
        raise CheckpointError(f"{info.path}: the memory plan needs {plan.total_gib:.1f} GiB, the GPU has "
                              f"{plan.device_gib:.1f} GiB (scripts/plan_device.py shows each part); lower "
                              f"rollout.prompts_per_step, trainer.micro_batch_size, lora.rank, or set trainer.dtype=bf16")
    log.info("loading %s (%s, %d MoE layers) in %s on %s", info.path, info.model_type, len(info.moe_layers()),
             cfg.trainer.dtype, device)
    model = load_model(info, cfg.trainer.dtype, device, implementation(cfg.model.experts_implementation))
    prompts = PromptFormat(cfg.data.task, checkpoint=True, chat_template=cfg.data.chat_template,
                           instruction=cfg.data.instruction, stop_ids=tuple(eos_token_ids(info, tokenizer)))
    meta = {"checkpoint": str(info.path), "model_type": info.model_type, "fingerprint": info.fingerprint(),
            "test_accuracy": None}
    return model, tokenizer, meta, prompts


def base_dir(cfg: ExperimentConfig) -> Path | None:
    """The directory the base model is read from: ``model.path``, else the warm start's cache entry; None
    for a random init (``warm_start.enabled=false``)."""
    if cfg.model.path:
        return Path(cfg.model.path)
    return warm_start_dir(cfg) if cfg.warm_start.enabled else None


def model_family(cfg: ExperimentConfig, model: torch.nn.Module | None = None) -> str:
    """The family (model_type) of the run's model: the checkpoint's, or the tiny preset's."""
    if cfg.model.path:
        return model.config.model_type if model is not None else json.loads(
            (Path(cfg.model.path) / "config.json").read_text())["model_type"]
    return cfg.model.preset
