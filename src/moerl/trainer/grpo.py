"""LoRA GRPO on a Mixture-of-Experts policy, embedded path. Read ``GRPOTrainer.step`` top to bottom:

    1. sample prompts; the rollout engine (own copy, own precision) samples G completions each,
       returning per-token rollout logprobs and the routing trace
    2. reward each completion (math-verify); normalise rewards within each group -> advantages
    3. old-logprob pass with the trainer's pre-update policy (R3 replays the rollout's routes,
       R2 records the trainer's own); skipped by the ``bypass`` loss (pi_old = pi_rollout)
    4. policy updates: mini-batches of micro-batches, the configured loss variant, replayed routes
       (R2/R3), gradient clipping, AdamW on the LoRA weights only
    5. refit: the new LoRA weights travel to the engine
    6. metrics: reward, mismatch (k3, IS weights), clipping, routing agreement per layer; log and
       checkpoint
"""
from __future__ import annotations

import dataclasses

import logging
import math
import os
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moerl.config import ExperimentConfig, config_hash, resolved_threads
from moerl.data import DataError, load_splits
from moerl.lora.export import export_adapter
from moerl.lora.peft_lora import apply_lora
from moerl.refit import make_refitter
from moerl.replay.trace import RoutingTrace
from moerl.reward import batch_rewards
from moerl.rollout.batch import RolloutBatch
from moerl.rollout.hf import HFEngine
from moerl.runlock import lock_run, unlock_run
from moerl.tracking import Tracker, check_logged_steps
from moerl.trainer.advantages import group_advantages
from moerl import faults
from moerl.identity import inputs_record
from moerl.trainer.checkpoint import (MANIFEST, check_same_base, check_same_inputs, checkpoint_dirs, checkpoint_step,
                                     load_checkpoint, predates_manifests, remove_incomplete, resumable_checkpoint,
                                     save_checkpoint)
from moerl.trainer.logprobs import forward_logprobs, session_trace, trainer_routing
from moerl.replay.diagnostics import routing_agreement
from moerl.trainer.losses import aggregate, aggregation_weight, check_finite, policy_loss
from moerl.trainer.metrics import (AgreementAlarm, extreme_token_curve, mismatch_metrics, paired_replay_effect,
                                  routing_divergence, token_samples)
from moerl.trainer.warm_start import (base_dir, evaluate_policy, load_base, model_family, warm_start_dir,
                                     weights_hash)

log = logging.getLogger(__name__)


class PromptSampler:
    """Walks seeded permutations of the training rows; its position is part of every checkpoint."""

    def __init__(self, rows: list[dict], seed: int):
        self.rows, self.seed, self.epoch, self.pos = rows, seed, 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 100003 + self.epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self.rows[self._order[self.pos]])
            self.pos += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._permutation()


@dataclass
class OldLogprobPass:
    """What the old-logprob pass produced: pi_old of every token, the experts the trainer's routers
    used (None when the pass was skipped) and the replay checks of that pass."""

    logp: torch.Tensor  # [N, T], aligned with RolloutBatch.rollout_logprobs
    routes: RoutingTrace | None = None  # [N, T-1, L_moe, k]: the trainer's forward positions
    violations: int = 0
    recompute_mismatches: int = 0


class Timer(dict):
    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[f"time/{name}"] = self.get(f"time/{name}", 0.0) + time.perf_counter() - start


def _chunks(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [rows[i: i + size] for i in range(0, len(rows), size)]


def _micro_batch_trace(replay: RoutingTrace | None, batch: RolloutBatch, sub: RolloutBatch,
                       rows: torch.Tensor) -> RoutingTrace | None:
    """The rows of ``replay`` for the micro-batch ``sub = batch.select(rows)``. R3 replays the batch's
    own trace, which ``select`` has already sliced: that slice is used rather than made again."""
    if replay is None:
        return None
    return sub.routing if replay is batch.routing else replay[rows]


class GRPOTrainer:
    def __init__(self, cfg: ExperimentConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
                 unverified_checkpoint: bool = False):
        self.cfg, self.run_dir, self.progress = cfg, Path(run_dir), progress
        self.train_rows, self.test_rows = check_splits(cfg)  # before anything is trained or written
        # One writer per run directory (scripts/run.py takes it earlier); the directory itself is locked
        # too, so deleting the lock file beside it lets no second writer in.
        lock_run(self.run_dir, create=not resume)
        legacy = False
        if resume:  # checked before any work: a resume that cannot happen says so at once
            saved = resumable_checkpoint(self.run_dir, cfg, unverified_ok=unverified_checkpoint)
            check_same_inputs(saved, self.run_dir, inputs_record(cfg))  # the data files, before any warm start
            legacy = not (saved / MANIFEST).exists() and predates_manifests(self.run_dir)
            # The rows it continues: every step up to the checkpoint logged once (no hole, no duplicate).
            check_logged_steps(self.run_dir / "metrics.jsonl", checkpoint_step(saved), cfg.trainer.steps)
            remove_incomplete(self.run_dir)  # a kill mid-prune of the last checkpoint leaves a .deleting
            for junk in (self.run_dir / "samples").glob(".step_*.npz"):  # a kill inside save_token_samples
                junk.unlink()
        threads = resolved_threads(cfg)
        torch.set_num_threads(threads)
        warn_passive_openmp(threads)
        warn_busy_cores(threads)
        torch.manual_seed(cfg.seed)
        base, self.tokenizer, self.warm_start_meta, self.prompts = load_base(cfg, progress=progress)
        self.base_hash = weights_hash(base)  # what the LoRA trains on, by content (run.json, every checkpoint)
        # the content of every file the run reads (data files, the base's config.json and tokenizer): run.json,
        # every checkpoint; a checkpoint's weight shards enter by size (base_hash covers the weights by content)
        self.inputs = inputs_record(cfg, base_dir(cfg), weights=not cfg.model.path)
        if resume:
            check_same_base(saved, self.base_hash, cfg.model.path or (
                str(warm_start_dir(cfg)) if cfg.warm_start.enabled else "the random init (warm_start.enabled=false)"))
            check_same_inputs(saved, self.run_dir, self.inputs)
        if cfg.model.path:  # rows whose rendered prompt is too long for the budget are dropped, as verl drops them
            self.train_rows = fitting_prompts(self.train_rows, self.prompts, self.tokenizer,
                                              cfg.data.max_prompt_tokens, "data.train_path")
            self.test_rows = fitting_prompts(self.test_rows, self.prompts, self.tokenizer,
                                             cfg.data.max_prompt_tokens, "data.test_path")
        self.test_rows = self.test_rows[: cfg.trainer.eval_size]
        self.family = model_family(cfg, base)

        self.policy = apply_lora(base, cfg.lora, self.family)
        if cfg.trainer.activation_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.trainable = {n: p for n, p in self.policy.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(self.trainable.values(), lr=cfg.trainer.lr,
                                           betas=tuple(cfg.trainer.betas), weight_decay=cfg.trainer.weight_decay)
        if cfg.refit.engine == "process":
            from moerl.refit.engine_process import EngineProcess

            self.engine = EngineProcess(cfg, self.policy)
        elif cfg.rollout.engine == "vllm":  # vLLM over the base weights; the adapter arrives by refit
            from moerl.rollout.vllm import VLLMAdapterRefit, VLLMEngine

            if cfg.model.path:  # vLLM reads the checkpoint's own files
                self.engine = VLLMEngine.from_checkpoint(self.policy, self.tokenizer, cfg.rollout, cfg.lora,
                                                         cfg.model.path, self.run_dir / "vllm_engine", self.prompts)
            else:
                self.engine = VLLMEngine.from_policy(self.policy, self.tokenizer, cfg.rollout, cfg.lora,
                                                     self.family, self.run_dir / "vllm_engine", cfg.data.task)
        else:
            self.engine = HFEngine(self.policy, self.tokenizer, cfg.rollout, self.prompts)
        self.refitter = (VLLMAdapterRefit(self.policy, self.engine) if cfg.rollout.engine == "vllm" else
                         make_refitter(cfg.refit, self.policy, self.engine, cfg.rollout.dtype))
        if cfg.trainer.fake_quant != "none":
            # The trainer computes on the rollout's quantised grid, rounded from the same weights the engine
            # rounded (after it was built, so neither rounds an already-rounded weight).
            from moerl.rollout.precision import fake_quantize_masters

            fake_quantize_masters(self.policy, cfg.trainer.fake_quant)
        self.sampler = PromptSampler(self.train_rows, cfg.seed)
        self.agreement_alarm = AgreementAlarm(cfg.replay.agreement_alarm)
        self.step_idx = 0
        if cfg.loss.variant == "bypass":
            log.warning("loss.variant=bypass skips the old-logprob pass (pi_old = pi_rollout): the trainer's "
                        "native routing is never computed, so routing/agreement* and mismatch/* (pi_old vs "
                        "pi_rollout, identical by construction) measure nothing in this run")

        resume_step = None
        if resume:
            state = load_checkpoint(saved, self.policy, self.optimizer)
            self.step_idx, resume_step = state["step"], state["step"]
            self.sampler.load(state["sampler"])
            # The engine gets the restored weights under the version they had when saved, so the
            # refit/version column continues exactly as in an uninterrupted run.
            self.refitter.version = state.get("refit_version", state["step"]) - 1
            # The R3 agreement alarm's no-replay reference (measured every paired_replay_every steps)
            # continues too: re-learning it would drop or change the alarm on the steps until the next one.
            self.agreement_alarm.reference = state.get("agreement_reference")
            self.refitter.sync()
            log.info("resumed %s at step %d", self.run_dir, self.step_idx)
        self.tracker = Tracker(self.run_dir, cfg, resume_step, base_hash=self.base_hash, legacy_run=legacy,
                               inputs=self.inputs)

    # ------------------------------------------------------------------------------------------
    # One GRPO step
    # ------------------------------------------------------------------------------------------
    def step(self) -> dict:
        cfg, timer = self.cfg, Timer()
        seed = cfg.seed * 1_000_003 + self.step_idx
        start = time.perf_counter()

        # 1. Rollout: G samples per prompt from the engine, with logprobs and routing trace.
        rows = self.sampler.next(cfg.rollout.prompts_per_step)
        with timer("rollout"):
            batch = self.engine.generate([r["question"] for r in rows], [r["answer"] for r in rows],
                                         cfg.rollout.group_size, seed=seed)
        mask = batch.response_mask
        check_finite("rollout_logprobs", batch.rollout_logprobs, mask)

        # 2. Reward and group-normalised advantages.
        batch.rewards = torch.tensor(batch_rewards(batch.texts, batch.answers, self.prompts.answers_after_hashes))
        advantages = group_advantages(batch.rewards, batch.group)[:, None].expand_as(mask).float()

        # 3. Old logprobs: the trainer's pre-update policy on the sampled tokens (skipped by the
        #    bypass loss, which takes pi_old = pi_rollout). Under R3 its routers replay the rollout's
        #    experts; otherwise they route natively, and what they chose is kept: R2 replays it in the
        #    updates, and against the rollout's trace it is the routing-agreement diagnostic.
        with timer("old_logprob"):
            if cfg.loss.variant == "bypass":
                old = OldLogprobPass(batch.rollout_logprobs)
            else:
                old = self.old_logprobs(batch, replay=batch.routing if cfg.replay.mode == "R3" else None)
        check_finite("old_logprobs", old.logp, mask)
        old_logp = old.logp
        # R3: the updates replay the rollout's experts; R2: the experts the trainer chose above.
        update_replay = {"none": None, "R2": old.routes, "R3": batch.routing}[cfg.replay.mode]
        with timer("consequence_metrics"):  # before the update: a paired pass needs the same weights
            consequences = self.consequence_metrics(batch, old)

        # 4. Policy updates (mini-batches x micro-batches), replaying routes under R2/R3.
        self.set_learning_rate()
        with timer("update"):
            update_metrics = self.update(batch, old_logp, advantages, update_replay, seed)

        # 5. Refit: only the LoRA weights travel to the engine.
        with timer("refit"):
            refit_metrics = self.refit()

        # 6. Metrics, log, checkpoint (time/step covers 1-5; evaluation is timed apart).
        step_seconds = time.perf_counter() - start
        self.step_idx += 1
        metrics = {"step": self.step_idx,
                   "reward/mean": float(batch.rewards.mean()),
                   "reward/mixed_group_frac": float(_mixed_groups(batch)),
                   "response/length_mean": float(batch.response_lengths.float().mean()),
                   "lr": self.optimizer.param_groups[0]["lr"],
                   **mismatch_metrics(old_logp, batch.rollout_logprobs, mask),
                   **update_metrics, **refit_metrics}
        if old.routes is not None and batch.routing is not None:
            metrics.update(routing_metrics(old.routes, batch.routing))
            metrics.update({"replay/old_pass_violations": old.violations,
                            "replay/old_pass_recompute_mismatches": old.recompute_mismatches})
        metrics.update(consequences)
        if cfg.trainer.samples_every and self.step_idx % cfg.trainer.samples_every == 0:
            self.save_token_samples(old_logp, batch, mask)
        if cfg.trainer.eval_every and self.step_idx % cfg.trainer.eval_every == 0:
            with timer("eval"):
                metrics.update(self.evaluate())
        metrics.update(timer)
        metrics["time/step"] = step_seconds
        self.tracker.log(metrics)
        if cfg.trainer.checkpoint_every and self.step_idx % cfg.trainer.checkpoint_every == 0:
            self.save()
        return metrics

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def old_logprobs(self, batch: RolloutBatch, replay: RoutingTrace | None) -> "OldLogprobPass":
        """Trainer logprobs before the update, in micro-batches, replaying ``replay`` if given, and the
        experts the trainer's routers used (a trace aligned with the trainer's forward)."""
        n = batch.input_ids.shape[0]
        logps, routes = [], []
        violations = recompute_mismatches = 0
        self.policy.eval()
        for rows in _chunks(torch.arange(n), self.cfg.trainer.micro_batch_size):
            sub = batch.select(rows)
            with trainer_routing(self.policy, sub, _micro_batch_trace(replay, batch, sub, rows),
                                 strict=self.cfg.replay.strict, layer_mapping=self.cfg.replay.layer_mapping) as session:
                logp, _ = forward_logprobs(self.policy, sub, self.cfg.rollout.temperature)
            logps.append(logp)
            routes.append(session_trace(session, sub))
            violations += session.violations
            recompute_mismatches += session.recompute_mismatches
        return OldLogprobPass(torch.cat(logps), RoutingTrace.cat(routes), violations, recompute_mismatches)

    def update(self, batch: RolloutBatch, old_logp, advantages, replay: RoutingTrace | None, seed: int) -> dict:
        cfg = self.cfg
        n, t = batch.input_ids.shape
        mask = batch.response_mask
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        grad_norms, skipped = [], 0
        checks = {"replay/violations": 0, "replay/recompute_mismatches": 0, "replay/checked_rows": 0}
        generator = torch.Generator().manual_seed(seed)
        self.policy.train()
        for _ in range(cfg.trainer.epochs):
            order = torch.randperm(n, generator=generator)
            for mini in _chunks(order, n // cfg.trainer.mini_batches):
                total = aggregation_weight(mask[mini], cfg.loss.aggregation)
                self.optimizer.zero_grad(set_to_none=True)
                finite = True
                for rows in _chunks(mini, cfg.trainer.micro_batch_size):
                    sub = batch.select(rows)
                    trace = _micro_batch_trace(replay, batch, sub, rows)
                    with trainer_routing(self.policy, sub, trace, strict=cfg.replay.strict,
                                         layer_mapping=cfg.replay.layer_mapping) as session:
                        logp, entropy = forward_logprobs(self.policy, sub, cfg.rollout.temperature,
                                                         with_entropy=True)
                        loss, m = policy_loss(logp, old_logp[rows], batch.rollout_logprobs[rows],
                                              advantages[rows], mask[rows], cfg.loss)
                        m["entropy"] = float(aggregate(entropy.detach(), mask[rows], "token_mean"))
                        if cfg.loss.entropy_coef:
                            loss = loss - cfg.loss.entropy_coef * aggregate(entropy, mask[rows], cfg.loss.aggregation)
                        if not torch.isfinite(loss):
                            finite = False
                            break
                        share = aggregation_weight(mask[rows], cfg.loss.aggregation) / max(total, 1e-9)
                        (loss * share).backward()
                    m["loss/policy"] = float(loss.detach())
                    checks["replay/violations"] += session.violations
                    checks["replay/recompute_mismatches"] += session.recompute_mismatches
                    if trace is not None:  # (valid row, MoE layer) pairs whose experts were checked
                        replayed = session.replay_trace
                        checks["replay/checked_rows"] += int(replayed.valid.sum()) * len(replayed.moe_layers)
                    w = float(mask[rows].sum())
                    for key, value in m.items():
                        sums[key] = sums.get(key, 0.0) + value * w
                        weights[key] = weights.get(key, 0.0) + w
                if not finite:
                    skipped += 1  # a NaN/inf loss would poison the LoRA weights: skip this update
                    self.optimizer.zero_grad(set_to_none=True)
                    log.warning("step %d: non-finite loss, update skipped", self.step_idx + 1)
                    continue
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.trainable.values(),
                                                                       cfg.trainer.grad_clip)))
                self.optimizer.step()
        out = {k: sums[k] / max(weights[k], 1e-9) for k in sums}
        out["grad_norm"] = float(np.mean(grad_norms)) if grad_norms else float("nan")
        out["updates/skipped_nonfinite"] = skipped
        if checks["replay/checked_rows"]:
            # Under R2/R3: share of replayed (row, layer) pairs whose experts equal the trace; 1.0 unless broken.
            out["routing/replayed_agreement"] = 1.0 - checks["replay/violations"] / checks["replay/checked_rows"]
        return {**out, **checks}

    def consequence_metrics(self, batch: RolloutBatch, old: OldLogprobPass) -> dict:
        """What the mismatch does (experiment 05): tokens re-routed in any layer, the extreme-ratio curve
        F(tau), and every ``trainer.paired_replay_every`` steps the same batch's old logprobs with and
        without replay (k3 ratio, bootstrap interval); the no-replay pass also sets the reference of the
        R3 agreement alarm. ``old.routes`` is the old pass's native routing (under R3, of replayed
        states). Runs before the update, so a paired pass sees the weights ``old.logp`` came from."""
        mask = batch.response_mask
        out = extreme_token_curve(old.logp, batch.rollout_logprobs, mask)
        if batch.routing is None or old.routes is None:
            return out
        rollout = batch.routing.truncate_tokens(old.routes.shape[1])  # the trainer's T-1 positions
        out.update(routing_divergence(old.routes, rollout))
        out["routing/duplicate_rows"] = float(batch.routing.duplicate_rows)

        def agreement(trace: RoutingTrace) -> float:
            per_layer = routing_agreement({n: trace.layer(n)[0] for n in rollout.moe_layers}, rollout)
            vals = [v for v in per_layer.values() if v == v]
            return float(np.mean(vals)) if vals else float("nan")

        every = self.cfg.trainer.paired_replay_every
        replays = self.cfg.replay.mode == "R3"  # the old pass replayed the rollout's routes
        if every and self.step_idx % every == 0:
            other = self.old_logprobs(batch, None if replays else batch.routing)
            self.agreement_alarm.observe_reference(agreement(other.routes if replays else old.routes))
            replayed, plain = (old.logp, other.logp) if replays else (other.logp, old.logp)
            out.update(paired_replay_effect(replayed, plain, batch.rollout_logprobs, mask, seed=self.step_idx))
        if replays:
            out.update(self.agreement_alarm.check(agreement(old.routes), self.step_idx + 1))
        return out

    def set_learning_rate(self) -> float:
        """Linear warm-up over trainer.warmup_steps, a function of the step alone (resume-exact)."""
        warmup = self.cfg.trainer.warmup_steps
        lr = self.cfg.trainer.lr * (min(1.0, (self.step_idx + 1) / warmup) if warmup else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def refit(self) -> dict:
        """Adapter-only (LoRA tensors) or merged (full weights) refit, bucketed and checksummed."""
        faults.hit("step")
        return self.refitter.sync()

    # ------------------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Held-out pass@1 and greedy accuracy, by the rollout engine or by an fp32 copy of the policy
        (``trainer.eval_precision``)."""
        engine = self.engine
        if self.cfg.trainer.eval_precision == "fp32":
            rollout = dataclasses.replace(self.cfg.rollout, engine="hf", dtype="fp32", kernels="native",
                                          capture_routing=False)
            engine = HFEngine(self.policy, self.tokenizer, rollout, self.prompts)
        acc = evaluate_policy(engine, self.test_rows, seed=self.cfg.data.seed,
                              samples=self.cfg.trainer.eval_samples)
        return {f"eval/{k}": v for k, v in acc.items()}

    def save_token_samples(self, old_logp, batch: RolloutBatch, mask) -> None:
        out = self.run_dir / "samples"
        out.mkdir(exist_ok=True)
        samples = token_samples(batch.rollout_logprobs, old_logp, mask, self.cfg.loss,
                                self.cfg.trainer.samples_per_save,
                                generator=torch.Generator().manual_seed(self.step_idx))
        final = out / f"step_{self.step_idx:05d}.npz"
        tmp = out / f".step_{self.step_idx:05d}.npz"
        try:
            np.savez_compressed(tmp, **samples)
        except OSError as err:  # a full disk: no half-written file left, the run resumable
            tmp.unlink(missing_ok=True)
            raise OSError(err.errno, f"could not write token samples {final} ({err.strerror or err}); no partial "
                                     f"file kept; free space and continue with --resume") from err
        tmp.rename(final)

    def save(self) -> None:
        """Checkpoint for exact resume, with the LoRA also exported as stock PEFT and vLLM adapters
        (``checkpoints/step_N/adapter/{peft,vllm}``; their base model is the warm start)."""
        base = self.cfg.model.path or (str(warm_start_dir(self.cfg)) if self.cfg.warm_start.enabled else "")
        save_checkpoint(self.run_dir, self.step_idx, self.trainable, self.optimizer,
                        {"sampler": self.sampler.state(), "refit_version": self.refitter.version,
                         "agreement_reference": self.agreement_alarm.reference},
                        export=lambda path: export_adapter(self.policy, self.cfg, path, base_model=base),
                        config_hash=config_hash(self.cfg), base_hash=self.base_hash, inputs=self.inputs,
                        keep=self.cfg.trainer.keep_checkpoints)
        faults.hit("after_checkpoint")

    def train(self) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        if self.step_idx == 0:
            initial = {"step": 0, **self.evaluate()}
            self.tracker.log(initial)
        bar = tqdm(total=cfg.trainer.steps, initial=self.step_idx, desc=cfg.run_name,
                   disable=not (self.progress and cfg.tracking.progress_bar))
        while self.step_idx < cfg.trainer.steps:
            last = self.step()
            bar.update(1)
            bar.set_postfix(reward=f"{last['reward/mean']:.3f}", k3=f"{last['mismatch/k3']:.2e}",
                            s=f"{last['time/step']:.2f}")
        bar.close()
        # The final evaluation, unless this step's row carries one (its eval_every, or a run killed
        # after logging it and resumed from this step's checkpoint: no row is ever logged twice).
        from moerl.tracking import read_metrics

        if not any(r.get("step") == self.step_idx and "eval/pass1" in r
                   for r in read_metrics(self.tracker.metrics_path)):
            final = {"step": self.step_idx, **self.evaluate()}
            self.tracker.log(final)
        faults.hit("final_eval")
        saved = checkpoint_dirs(self.run_dir)
        if not saved or saved[-1].name != f"step_{self.step_idx}":
            self.save()
        summary = self.summarise()
        self.tracker.write_summary(summary)
        self.close()
        return summary

    def close(self) -> None:
        self.tracker.close()
        if hasattr(self.engine, "close"):
            self.engine.close()
        unlock_run(self.run_dir)

    def summarise(self) -> dict:
        from moerl.tracking import read_metrics

        rows = read_metrics(self.tracker.metrics_path)
        train = [r for r in rows if "reward/mean" in r]
        evals = [r for r in rows if "eval/pass1" in r]

        def mean_of(key):
            vals = [r[key] for r in train if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            return float(np.mean(vals)) if vals else None

        keys = sorted({k for r in train for k in r if k.startswith(("mismatch/", "clip/", "is/", "mask/",
                                                                     "effective/", "routing/", "time/",
                                                                     "replay_effect/"))})
        return {"run": self.cfg.run_name, "steps": self.step_idx,
                "warm_start_accuracy": self.warm_start_meta.get("test_accuracy"),
                # Step 0's row, never a later evaluation standing in for a lost one.
                "initial_eval": next(({k: v for k, v in r.items() if k.startswith("eval/")} for r in evals
                                      if r.get("step") == 0), None),
                "final_eval": {k: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else None,
                "reward_first10": float(np.mean([r["reward/mean"] for r in train[:10]])) if train else None,
                "reward_last10": float(np.mean([r["reward/mean"] for r in train[-10:]])) if train else None,
                **{f"mean/{k}": mean_of(k) for k in keys}}


def warn_passive_openmp(threads: int) -> None:
    """A run on several threads under ``OMP_WAIT_POLICY=PASSIVE`` puts its OpenMP threads to sleep after
    every op and wakes them for the next: on this repo's small models that made a 2-thread step 1.9x
    slower (results/step/omp_wait_policy). PASSIVE only helps several multi-threaded processes share cores."""
    if threads > 1 and os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        log.warning("OMP_WAIT_POLICY=PASSIVE with %d threads: OpenMP threads sleep between ops, which made a "
                    "2-thread step 1.9x slower on a 2-core Xeon; unset it when this run has the cores to itself",
                    threads)


def warn_busy_cores(threads: int, load: float | None = None, cores: int | None = None) -> None:
    """A run on several OpenMP threads that share their cores with other busy work waits at every op for
    its slowest thread: on this repo's small models such a step runs many times slower than the same
    step on one thread. Warned at start from the 1-minute load average (``load``, ``cores``: the
    machine's, unless given)."""
    if threads <= 1:
        return
    load = os.getloadavg()[0] if load is None else load
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    if load + threads > cores + 0.5:
        log.warning("%d threads on %d cores whose 1-minute load is already %.1f: the threads will share cores "
                    "with other work and every step waits for the slowest; run with threads=1 (or %d) or when "
                    "the machine is idle", threads, cores, load, max(1, int(cores - load)))


def check_splits(cfg: ExperimentConfig) -> tuple[list[dict], list[dict]]:
    """The task's (train, test) rows, or a DataError naming the file: a run needs both (a pass@1
    of 0.0 measured on no test rows would be reported as a result). The rows are checked against the
    model (unknown characters warned about, prompts longer than its positions refused), and
    ``model.overrides`` by building the model, before anything is written."""
    from moerl.data.checks import check_rows
    from moerl.data.tokenizer import build_tokenizer
    from moerl.models.presets import check_overrides, max_positions

    train, test = load_splits(cfg.data)
    if not test:
        raise DataError(f"data.task={cfg.data.task}: no test rows to evaluate on "
                        f"(set data.test_path{' or data.hub_id' if cfg.data.task != 'arith' else ''})")
    if cfg.model.path:  # the checkpoint directory's files, before any weight is read (its own tokenizer later)
        from moerl.models.pretrained import inspect_checkpoint

        inspect_checkpoint(cfg.model.path)
        return train, test
    check_overrides(cfg.model, build_tokenizer())
    check_rows(cfg, train, test[: cfg.trainer.eval_size], max_positions(cfg.model))
    return train, test


def fitting_prompts(rows: list[dict], prompts, tokenizer, limit: int, key: str) -> list[dict]:
    """The rows whose rendered prompt has at most ``limit`` tokens; the others are counted and logged. A
    split left empty is a DataError naming the key."""
    lengths = [len(ids) for ids in prompts.token_ids(tokenizer, [r["question"] for r in rows])]
    kept = [r for r, n in zip(rows, lengths) if n <= limit]
    if len(kept) < len(rows):
        log.warning("%s: dropped %d of %d rows whose prompt is longer than data.max_prompt_tokens=%d tokens",
                    key, len(rows) - len(kept), len(rows), limit)
    if not kept:
        raise DataError(f"{key}: every prompt is longer than data.max_prompt_tokens={limit} tokens (longest "
                        f"{max(lengths)}); raise data.max_prompt_tokens")
    return kept


def _mixed_groups(batch: RolloutBatch) -> float:
    """Fraction of groups with mixed rewards (the only groups that carry a GRPO signal)."""
    mixed = [float(batch.rewards[batch.group == g].std() > 0) for g in batch.group.unique()]
    return sum(mixed) / len(mixed)


def routing_metrics(native: RoutingTrace, rollout: RoutingTrace) -> dict:
    """Per-layer agreement between the trainer's native top-k and the rollout's, on valid rows
    (with replay off this *is* the routing mismatch; under R3 it shows what replay corrects).
    ``native`` covers the trainer's forward positions (T-1), ``rollout`` the whole batch."""
    rollout = rollout.truncate_tokens(native.indices.shape[1])
    per_layer = routing_agreement({n: native.layer(n)[0] for n in native.moe_layers}, rollout)
    out = {f"routing/agreement/layer{n}": v for n, v in per_layer.items()}
    vals = [v for v in per_layer.values() if v == v]
    out["routing/agreement"] = float(np.mean(vals)) if vals else float("nan")
    out["routing/disagreement"] = 1.0 - out["routing/agreement"]
    return out
