"""moerl's GRPO step against TRL's GRPOTrainer doing the same work, alternated in one process.

    .venv-peer/bin/python benchmarks/bench_peer.py [--arm experiments/00_tiny_moe_cpu/arms/baseline.yaml]
        [--rounds 8] [--per-round 2] [--warmup 1] [--threads 1] [--structures matched,default]
        [--out DIR | --record] [key=value ...]

(``.venv-peer`` comes from scripts/setup_peer_env.sh; moerl must be importable there, which the editable
install does; this script also puts ``src/`` on the path.)

Why: a step time means little alone. TRL's GRPOTrainer is the reference LoRA GRPO implementation most
readers know, so we time it on exactly the work moerl does in one step and report ``moerl / TRL``.
Target: moerl's step at most 0.8x TRL's with the matched structure, moerl's extra work included; at most
0.4x on experiment 07's task (answers of 25-33 tokens, where decoding dominates).

Same on both sides: the arm's warm-start model (TRL gets a deep copy), the LoRA (q/k/v/o plus the fused
expert tensors via PEFT ``target_parameters``, moerl.lora.peft_lora.peft_config, same rank/alpha and the
same init seed), the arm's training rows rendered as moerl renders them (``<bos>`` + prompt template), the
reward (moerl.reward's math-verify reward; each side keeps its own completion-level cache of the same
size, math-verify's parse caches are shared), prompts x samples per generation (32 x 8 = 256
completions), max new tokens (8), temperature 1 (top-p 1, no top-k), lr, PPO clip 0.2/0.28, token-mean
loss (TRL's ``dapo``), no KL term (beta=0), no MoE load-balancing loss, grad-norm clip 1.0, AdamW
(torch.optim.AdamW, betas 0.9/0.999, no weight decay, constant lr), micro-batches of
``trainer.micro_batch_size`` (128), fp32 training, no gradient checkpointing, torch threads.

What one timed unit does (one generation round = 256 completions):

  moerl ``GRPOTrainer.step()`` (the arm's step, everything it does, timed as the wall around the call):
    1. generation by the rollout engine: its own bf16 copy of the policy (PEFT model, expert LoRA folded
       once per generate), routing capture on every router, per-token rollout logprobs from the logits;
    2. reward (math-verify) and group-normalised advantages;
    3. old-logprob pass: the fp32 trainer policy, no grad, micro-batches of 128, its routing recorded
       (replayed under R2/R3 arms; baseline only records it) for the routing-agreement metrics;
    4. ``trainer.mini_batches`` (2) AdamW steps of 128 completions each;
    5. refit: the new LoRA tensors copied into the bf16 engine;
    6. metrics (mismatch k3, IS weights, routing agreement, F(tau)) and the metrics log line.
    Evaluation, checkpoints and token samples are switched off (TRL does none of them either).

  TRL ``GRPOTrainer`` (TRL's own train() loop; timed from its ``on_step_begin`` to ``on_step_end``
  callbacks, summed over the optimizer steps of one generation round):
    - generation with the training policy itself (fp32 PeftModel, ``model.generate``; PEFT folds the
      expert LoRA on every forward), no routing capture, no separate engine, hence no refit;
    - reward and advantages (scale_rewards="group", as moerl);
    matched structure (``steps_per_generation=2``, ``gradient_accumulation_steps=1``,
    ``per_device_train_batch_size=128``): an old-logprob pass (TRL computes one whenever
    gradient_accumulation_steps is not a multiple of steps_per_generation), then 2 optimizer steps of 128;
    default structure (``steps_per_generation=gradient_accumulation_steps=2``): no old-logprob pass (TRL
    takes the detached logprobs of the update forward), 1 optimizer step over 256 completions in 2
    micro-batches of 128.
  Outside TRL's timed windows: fetching the next prompt batch and TRL's logging between steps; their
  median is reported as ``gap`` (moerl's metric logging is inside its timed step).

Schedule: ``--warmup`` untimed turns, then ``--rounds`` rounds; in each round every side does
``--per-round`` generation rounds in turn, the order reversed every other round (machine noise hits all
sides alike). Threads: ``--threads 1`` (the default) gives the clean comparison. With more, each side's
worker thread has its own OpenMP team, and with more team threads than cores libgomp cuts how long idle
threads spin before sleeping: every side slowed 1.3-1.7x at ``--threads 2`` on a 2-core CPU (moerl's
step 1.21 s against 0.70 s at one thread and 0.48 s in benchmarks/bench_step.py), the ratio did not move.
Each TRL trainer runs its train() in a worker thread that hands control back at a step
boundary after its turn (moerl's steps run in a worker thread too); only one side computes at any time. Prints medians, min-max, ``moerl / TRL`` per
structure and whether the target is met; checks that every generation round produced N completions of
at most max-new-tokens tokens, that TRL ran the old-logprob pass exactly when expected, and that both
sides' LoRA weights changed. Writes ``<out>/bench_peer.json``.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from moerl.bench_output import add_output_args, output_dir  # noqa: E402

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

TARGET = 0.8  # moerl's step / TRL's step, matched structure
TARGETS = {"07_dose_threshold": 0.4}  # per experiment, where it differs
STRUCTURES = ("matched", "default")
DEFAULT_ARM = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"


# ------------------------------------------------------------------------------------------------
# Pure helpers (tested without TRL)
# ------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", default=DEFAULT_ARM)
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (>= 4 for a figure worth quoting)")
    ap.add_argument("--per-round", type=int, default=2, help="generation rounds per side per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed generation rounds per side first")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for both sides")
    ap.add_argument("--structures", default=",".join(STRUCTURES),
                    help="comma-separated TRL structures to time: matched (steps_per_generation=2, old-logprob "
                         "pass, 2 updates) and/or default (1 update per generation, no old-logprob pass)")
    add_output_args(ap, "results/peer")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value, as scripts/run.py takes them")
    args = ap.parse_args(argv)
    for name in ("rounds", "per_round", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    args.structures = [x for x in args.structures.split(",") if x]
    if not args.structures or any(x not in STRUCTURES for x in args.structures):
        ap.error(f"--structures: a comma-separated subset of {','.join(STRUCTURES)}")
    return args


def trl_batch(n_completions: int, group_size: int, micro_batch_size: int, mini_batches: int, epochs: int,
              structure: str) -> dict:
    """TRL GRPOConfig batch fields doing moerl's generation round of ``n_completions``.

    matched: one optimizer step per moerl mini-batch (``steps_per_generation`` = micro-batches per
    generation, ``gradient_accumulation_steps`` = micro-batches per mini-batch); default: TRL's own default
    shape (``steps_per_generation`` = ``gradient_accumulation_steps``), one optimizer step per generation.
    """
    if epochs != 1:
        raise ValueError("trainer.epochs != 1: TRL's num_iterations re-generates nothing but repeats whole "
                         "generation batches; only epochs=1 is mapped here")
    if n_completions % mini_batches or (n_completions // mini_batches) % micro_batch_size:
        raise ValueError(f"{n_completions} completions do not split into {mini_batches} mini-batches of "
                         f"whole micro-batches of {micro_batch_size}")
    micro_per_gen = n_completions // micro_batch_size
    if structure == "matched":
        ga = n_completions // mini_batches // micro_batch_size
    elif structure == "default":
        ga = micro_per_gen
    else:
        raise ValueError(f"structure must be one of {STRUCTURES}, not {structure!r}")
    return {"per_device_train_batch_size": micro_batch_size, "gradient_accumulation_steps": ga,
            "steps_per_generation": micro_per_gen, "num_generations": group_size,
            "optimizer_steps_per_generation": micro_per_gen // ga,
            # TRL's rule (GRPOTrainer._generate_and_score_completions, use_vllm=False, num_iterations=1)
            "old_logprob_pass": ga % micro_per_gen != 0}


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarise(rounds: list[dict[str, list[float]]], target: float = TARGET) -> dict:
    """Per-side medians/min/max over every timed generation round and ``moerl / TRL`` per structure.

    ``rounds``: one dict per timed round, side -> seconds of each generation round it did in that round
    (sides: ``moerl`` and ``trl_<structure>``). ``ratio`` is median over median; ``paired_ratio`` the
    median over rounds of the per-round mean ratio (less sensitive to drifts in machine load)."""
    sides = sorted({s for r in rounds for s in r})
    if "moerl" not in sides:
        raise ValueError("no moerl times")
    per_side = {s: _stats([t for r in rounds for t in r.get(s, [])]) for s in sides}
    out = {"sides": per_side, "structures": {}, "target": target}
    for side in sides:
        if not side.startswith("trl_"):
            continue
        structure = side[len("trl_"):]
        ratio = per_side["moerl"]["median"] / per_side[side]["median"]
        paired = [statistics.fmean(r["moerl"]) / statistics.fmean(r[side]) for r in rounds
                  if r.get("moerl") and r.get(side)]
        out["structures"][structure] = {"ratio": ratio, "trl_over_moerl": 1.0 / ratio,
                                        "paired_ratio": statistics.median(paired) if paired else None,
                                        "target_met": ratio <= target}
    if "matched" in out["structures"]:
        out["target_met"] = out["structures"]["matched"]["target_met"]
    return out


def report(summary: dict) -> str:
    lines = [f"{'side':14s} {'median s':>9s} {'min s':>8s} {'max s':>8s} {'n':>4s}   (one generation round each)"]
    for side, s in summary["sides"].items():
        lines.append(f"{side:14s} {s['median']:9.3f} {s['min']:8.3f} {s['max']:8.3f} {s['n']:4d}")
    for structure, r in summary["structures"].items():
        paired = f", paired per-round {r['paired_ratio']:.2f}" if r["paired_ratio"] is not None else ""
        lines.append(f"moerl / TRL ({structure}): {r['ratio']:.2f} (TRL {r['trl_over_moerl']:.2f}x moerl{paired})"
                     f"   target <= {summary['target']:g}: {'met' if r['target_met'] else 'NOT met'}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# The two sides
# ------------------------------------------------------------------------------------------------
def trainable_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> dict:
    now = dict(model.named_parameters())
    diffs = {n: float((now[n].detach() - t).abs().max()) for n, t in before.items()}
    return {"tensors": len(diffs), "changed": sum(d > 0 for d in diffs.values()),
            "max_abs_change": max(diffs.values()) if diffs else 0.0}


class MoerlSide:
    """moerl's GRPOTrainer; each generation round is one ``step()``, timed as the wall around it.

    The steps run in a worker thread of their own, as each TRL trainer's loop does: every side computes on
    its own thread (its own OpenMP pool when --threads > 1), none on the main thread."""

    def __init__(self, cfg, run_dir: Path, threads: int):
        from moerl.trainer.grpo import GRPOTrainer

        self.trainer = GRPOTrainer(cfg, run_dir, progress=False)
        self.generations: list[dict] = []
        engine_generate = self.trainer.engine.generate

        def generate(*a, **kw):  # records what each generation produced (cheap, outside the math)
            batch = engine_generate(*a, **kw)
            lengths = batch.response_mask.sum(1)
            self.generations.append({"completions": int(lengths.numel()), "max_new_tokens": int(lengths.max())})
            return batch

        self.trainer.engine.generate = generate
        self.initial = trainable_snapshot(self.trainer.policy)
        self.phases: list[dict] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moerl")
        self._pool.submit(torch.set_num_threads, threads).result()

    def run(self, gens: int) -> list[float]:
        return self._pool.submit(self._steps, gens).result()

    def _steps(self, gens: int) -> list[float]:
        times = []
        for _ in range(gens):
            start = time.perf_counter()
            metrics = self.trainer.step()
            times.append(time.perf_counter() - start)
            self.phases.append({k: v for k, v in metrics.items() if k.startswith("time/")})
        return times

    def close(self) -> None:
        self._pool.shutdown()
        self.trainer.close()


class _Aborted(Exception):
    """Raised inside TRL's loop to stop it when the bench fails elsewhere."""


class _TurnTaking(TrainerCallback):
    """Times TRL's optimizer steps and pauses TRL's loop between turns (see TRLSide)."""

    def __init__(self, side: "TRLSide"):
        self.side = side

    def on_step_begin(self, args, state, control, **kwargs):
        s = self.side
        s._begin = time.perf_counter()
        s._gens_at_begin, s._gen_s_at_begin = s.generations_done, s.gen_seconds
        if s._resumed_at is not None:
            s.gaps.append(s._begin - s._resumed_at)
        s.threads_seen.add(torch.get_num_threads())

    def on_step_end(self, args, state, control, **kwargs):
        s = self.side
        end = time.perf_counter()
        s.steps.append({"seconds": end - s._begin, "generations": s.generations_done - s._gens_at_begin,
                        "generate_and_score_seconds": s.gen_seconds - s._gen_s_at_begin, "turn": s.turn})
        s._round_seconds += end - s._begin
        s._resumed_at = time.perf_counter()
        if state.global_step % s.opt_per_gen == 0:  # this optimizer step closed a generation round
            s.round_times.append(s._round_seconds)
            s._round_seconds = 0.0
            s._quota -= 1
            if s._quota == 0:
                s._hand_back()
                s._resumed_at = time.perf_counter()


class TRLSide:
    """TRL's GRPOTrainer on a deep copy of the warm start, running its own ``train()`` in a worker thread.

    ``run(gens)`` lets TRL's loop go on for ``gens`` generation rounds; the loop then blocks inside a
    callback (after ``on_step_end``, outside every timed window) until the next ``run``. Only one side
    computes at any time, so the alternation is as fair as with sequential calls, and TRL's loop is
    TRL's own: one train() call, one optimizer, TRL's generation buffer and step counter untouched."""

    def __init__(self, structure: str, cfg, base_model, tokenizer, train_rows, total_gens: int, out_dir: Path,
                 threads: int):
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from moerl.data.prompts import render_prompt
        from moerl.data.tokenizer import BOS
        from moerl.lora.peft_lora import peft_config
        from moerl import reward

        r, t = cfg.rollout, cfg.trainer
        self.structure, self.threads = structure, threads
        self.n = r.prompts_per_step * r.group_size
        self.max_new_tokens = r.max_new_tokens
        self.plan = trl_batch(self.n, r.group_size, t.micro_batch_size, t.mini_batches, t.epochs, structure)
        self.opt_per_gen = self.plan["optimizer_steps_per_generation"]
        args = GRPOConfig(
            output_dir=str(out_dir), max_steps=total_gens * self.opt_per_gen, seed=cfg.seed,
            use_cpu=True, bf16=False, fp16=False,  # fp32 training, as moerl's trainer (TRL defaults to bf16)
            gradient_checkpointing=False,  # TRL defaults to True; moerl's arm has it off
            per_device_train_batch_size=self.plan["per_device_train_batch_size"],
            gradient_accumulation_steps=self.plan["gradient_accumulation_steps"],
            steps_per_generation=self.plan["steps_per_generation"], num_generations=r.group_size,
            max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            use_vllm=False, beta=0.0, num_iterations=t.epochs, epsilon=cfg.loss.eps_low,
            epsilon_high=cfg.loss.eps_high, loss_type="dapo",  # token-mean over the optimizer step's batch
            scale_rewards="group", router_aux_loss_coef=0.0, mask_truncated_completions=False,
            learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
            adam_beta1=t.betas[0], adam_beta2=t.betas[1], max_grad_norm=t.grad_clip, optim="adamw_torch",
            report_to="none", save_strategy="no", logging_steps=10, disable_tqdm=True, log_completions=False,
            dataloader_num_workers=0, dataloader_pin_memory=False)
        if args.generation_batch_size != self.n or args.steps_per_generation != self.plan["steps_per_generation"]:
            raise RuntimeError(f"TRL resolved generation_batch_size={args.generation_batch_size}, "
                               f"steps_per_generation={args.steps_per_generation}; wanted {self.n}")
        dataset = Dataset.from_list([{"prompt": BOS + render_prompt(cfg.data.task, row["question"]),
                                      "answer": row["answer"]} for row in train_rows])
        self.rewards: list[dict] = []
        own_cache = lru_cache(maxsize=reward.CACHE_SIZE)(reward.math_reward_uncached)

        def math_verify(completions, answer, completion_ids=None, **_):
            """moerl.reward.batch_rewards' function with a cache of its own (TRL's completions)."""
            self.rewards.append({"completions": len(completions),
                                 "max_new_tokens": max((len(c) for c in completion_ids), default=0)})
            return [own_cache(c, a) for c, a in zip(completions, answer)]

        torch.manual_seed(cfg.lora.init_seed)  # as moerl.lora.peft_lora.apply_lora: the same initial adapter
        self.trainer = GRPOTrainer(model=copy.deepcopy(base_model), reward_funcs=[math_verify], args=args,
                                   train_dataset=dataset, processing_class=tokenizer,
                                   peft_config=peft_config(cfg.lora, cfg.model.preset),
                                   callbacks=[_TurnTaking(self)])
        self.initial = trainable_snapshot(self.trainer.model)

        # Count generation rounds and what they produced: wrap TRL's generate-and-score (an attribute
        # lookup TRL's _prepare_inputs makes on every micro-step).
        self.generations_done, self.gen_seconds, self.generations = 0, 0.0, []
        original = self.trainer._generate_and_score_completions

        def generate_and_score(inputs):
            start = time.perf_counter()
            out = original(inputs)
            self.gen_seconds += time.perf_counter() - start
            self.generations_done += 1
            lengths = out["completion_mask"].sum(1)
            self.generations.append({"completions": int(lengths.numel()), "max_new_tokens": int(lengths.max()),
                                     "old_logprob_pass": out.get("old_per_token_logps") is not None})
            return out

        self.trainer._generate_and_score_completions = generate_and_score

        self.steps: list[dict] = []
        self.round_times: list[float] = []
        self.gaps: list[float] = []
        self.threads_seen: set[int] = set()
        self.turn = -1
        self._round_seconds, self._resumed_at, self._quota = 0.0, None, 0
        self._resume, self._yielded = threading.Semaphore(0), threading.Semaphore(0)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.finished = self._abort = False

    # -- turn taking (main thread: run/finish; worker: _train/_hand_back) ----------------------------
    def run(self, gens: int) -> list[float]:
        self.turn += 1
        self._quota, first = gens, len(self.round_times)
        if self._thread is None:
            self._thread = threading.Thread(target=self._train, name=f"trl-{self.structure}", daemon=True)
            self._thread.start()
        else:
            self._resume.release()
        self._yielded.acquire()
        if self.error is not None:
            raise RuntimeError(f"TRL ({self.structure}) failed") from self.error
        return self.round_times[first:]

    def finish(self, abort: bool = False) -> None:
        """Let train() return (normally no step is left by now); ``abort`` stops it at its pause instead."""
        if self._thread is None:
            return
        self._quota, self._abort = -1, abort  # -1: no more pauses
        if not self.finished:
            self._resume.release()
            self._yielded.acquire()
        self._thread.join()
        if self.error is not None and not isinstance(self.error, _Aborted):
            raise RuntimeError(f"TRL ({self.structure}) failed") from self.error

    def _train(self) -> None:
        torch.set_num_threads(self.threads)  # the same intra-op threads as the main thread
        try:
            self.trainer.train()
        except BaseException as exc:  # handed to the main thread by run()/finish()
            self.error = exc
        finally:
            self.finished = True
            self._yielded.release()

    def _hand_back(self) -> None:
        self._yielded.release()
        self._resume.acquire()
        if self._abort:
            raise _Aborted


# ------------------------------------------------------------------------------------------------
def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "math-verify"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("bench_peer needs TRL: build .venv-peer with scripts/setup_peer_env.sh and run it there")
    from moerl.config import load_config
    from moerl.tracking import machine_info
    from moerl.trainer.warm_start import load_warm_start

    overrides = ["trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.samples_every=0",
                 "tracking.wandb_mode=disabled", "tracking.progress_bar=false", *args.overrides,
                 f"threads={args.threads}"]
    cfg = load_config(args.arm, overrides)
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    per_side_gens = args.warmup + args.rounds * args.per_round
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.set_num_threads(args.threads)
        moerl = MoerlSide(cfg, tmp / "moerl", args.threads)
        base, tokenizer, _ = load_warm_start(cfg, progress=False)  # the cached warm start moerl just loaded
        trls = {s: TRLSide(s, cfg, base, tokenizer, moerl.trainer.train_rows, per_side_gens, tmp / f"trl_{s}",
                           args.threads) for s in args.structures}
        torch.set_num_threads(args.threads)  # after every constructor: the same threads for all sides
        moerl_params = sum(p.numel() for p in moerl.initial.values())
        checks = {"trainable_params": {"moerl": moerl_params},
                  "same_initial_lora": {}, "same_base_weights": {}}
        moerl_frozen = {k: p for k, p in moerl.trainer.policy.named_parameters() if not p.requires_grad}
        for s, side in trls.items():
            checks["trainable_params"][f"trl_{s}"] = sum(p.numel() for p in side.initial.values())
            checks["same_initial_lora"][f"trl_{s}"] = (side.initial.keys() == moerl.initial.keys() and all(
                torch.equal(side.initial[k], moerl.initial[k]) for k in side.initial))
            frozen = {k: p for k, p in side.trainer.model.named_parameters() if not p.requires_grad}
            checks["same_base_weights"][f"trl_{s}"] = (frozen.keys() == moerl_frozen.keys() and all(
                torch.equal(frozen[k], moerl_frozen[k]) for k in frozen))
        if any(v != moerl_params for v in checks["trainable_params"].values()):
            raise RuntimeError(f"trainable parameters differ: {checks['trainable_params']}")
        print(f"trainable LoRA parameters: {moerl_params:,} on every side; TRL plans: "
              + "; ".join(f"{s}: {side.plan}" for s, side in trls.items()), flush=True)

        sides = {"moerl": moerl.run, **{f"trl_{s}": side.run for s, side in trls.items()}}
        order = list(sides)
        rounds: list[dict[str, list[float]]] = []
        failed = True
        try:
            if args.warmup:
                for name in order:
                    sides[name](args.warmup)
                print(f"warm-up: {args.warmup} generation round(s) per side done", flush=True)
            for i in range(args.rounds):
                row = {}
                for name in (order if i % 2 == 0 else order[::-1]):
                    row[name] = sides[name](args.per_round)
                rounds.append(row)
                print(f"round {i + 1}/{args.rounds}: " + ", ".join(
                    f"{k} {statistics.fmean(v):.3f} s" for k, v in row.items()), flush=True)
            failed = False
        finally:
            for side in trls.values():
                side.finish(abort=failed)
            moerl.close()

        # What each side did per generation round: N completions of <= max_new_tokens, the old pass.
        gen_checks = {"moerl": moerl.generations}
        for s, side in trls.items():
            gen_checks[f"trl_{s}"] = side.generations
            checks.setdefault("trl_reward_calls", {})[f"trl_{s}"] = side.rewards
        problems = [f"{name}: base weights differ from moerl's warm start"
                    for name, same in checks["same_base_weights"].items() if not same]
        for name, gens in gen_checks.items():
            if len(gens) != per_side_gens:
                problems.append(f"{name}: {len(gens)} generation rounds, expected {per_side_gens}")
            for g in gens:
                if g["completions"] != n or g["max_new_tokens"] > cfg.rollout.max_new_tokens:
                    problems.append(f"{name}: a generation round gave {g}")
                    break
        for s, side in trls.items():
            if any(g["old_logprob_pass"] != side.plan["old_logprob_pass"] for g in side.generations):
                problems.append(f"trl_{s}: old-logprob pass not as planned ({side.plan['old_logprob_pass']})")
            gens_per_step = [st["generations"] for st in side.steps]
            expected = ([1] + [0] * (side.opt_per_gen - 1)) * per_side_gens
            if gens_per_step != expected:
                problems.append(f"trl_{s}: generations per optimizer step {gens_per_step[:8]}..., expected "
                                f"{expected[:8]}...")
            if side.threads_seen != {args.threads}:
                problems.append(f"trl_{s}: torch threads seen {side.threads_seen}, expected {args.threads}")
        lora_changed = {"moerl": changed(moerl.initial, moerl.trainer.policy),
                        **{f"trl_{s}": changed(side.initial, side.trainer.model) for s, side in trls.items()}}
        for name, c in lora_changed.items():
            if c["changed"] == 0:
                problems.append(f"{name}: no LoRA tensor changed")

    summary = summarise(rounds, TARGETS.get(cfg.experiment, TARGET))
    print()
    print(report(summary))
    trl_detail = {}
    for s, side in trls.items():
        timed = [st for st in side.steps if st["turn"] >= (1 if args.warmup else 0)]
        gen_s = [st["generate_and_score_seconds"] for st in timed if st["generations"]]
        trl_detail[f"trl_{s}"] = {
            "plan": side.plan, "optimizer_steps": len(side.steps),
            "median_generate_and_score_s": statistics.median(gen_s) if gen_s else None,
            "median_gap_between_steps_s": statistics.median(side.gaps) if side.gaps else None}
        print(f"trl_{s}: generate+score (incl. old-logprob pass when run) median "
              f"{trl_detail[f'trl_{s}']['median_generate_and_score_s']:.3f} s per generation round; "
              f"untimed gap between TRL steps median "
              f"{(trl_detail[f'trl_{s}']['median_gap_between_steps_s'] or 0.0):.4f} s")
    timed_phases = moerl.phases[args.warmup:]
    moerl_phases = {k: statistics.median(p[k] for p in timed_phases if k in p)
                    for k in sorted({k for p in timed_phases for k in p})}
    print("moerl phases (median s): " + ", ".join(f"{k[5:]} {v:.3f}" for k, v in moerl_phases.items()))
    print("LoRA changed: " + ", ".join(f"{k} {v['changed']}/{v['tensors']}" for k, v in lora_changed.items()))
    print("checks: " + ("all passed" if not problems else "FAILED: " + "; ".join(problems)))

    result = {"arm": args.arm, "overrides": args.overrides, "threads": args.threads, "rounds": args.rounds,
              "per_round": args.per_round, "warmup": args.warmup, "structures": args.structures,
              "completions_per_generation": n, "max_new_tokens": cfg.rollout.max_new_tokens,
              "per_round_seconds": rounds, **summary, "moerl_phase_medians": moerl_phases, "trl": trl_detail,
              "checks": {**checks, "lora_changed": lora_changed, "generations": gen_checks,
                         "problems": problems},
              "versions": versions(), "machine": machine_info(), "when": time.strftime("%Y-%m-%d %H:%M")}
    out = output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_peer.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'bench_peer.json'}")
    if problems:
        raise SystemExit("bench_peer: checks failed (see above); the timings are not comparable")
    return result


if __name__ == "__main__":
    main()
