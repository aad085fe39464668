"""A rollout engine in its own process, as vLLM runs: refit buckets arrive through shared memory.

The worker builds the policy architecture from the experiment config, loads the trainer's initial
base weights (and adapter), and serves requests over a pipe: refit (plan once, then stage bucket /
commit), logits, generate (through moerl.rollout.hf.HFEngine) and its effective weights. The
staging buffer of a refit (every bucket at its own offset) is a torch tensor in shared memory
(``share_memory_``), handed to the worker once with the plan: the trainer packs straight into it and
sends only (version, bucket, checksum) messages; the worker checks each bucket where it lies while the
next one is packed, and at commit copies the weights out of it.
"""
from __future__ import annotations

import traceback
from typing import Any

import torch

from moerl.rollout.precision import compute_dtype
import torch.multiprocessing as mp

from moerl.refit.plan import CorruptBucketError, RefitError, TransferPlan, bucket_region
from moerl.refit.receiver import Receiver, new_staging

_CTX = mp.get_context("spawn")


def _build_engine(cfg, mode: str, base: dict, adapter: dict | None):
    """(engine or None, model): the HFEngine when it imports, else the bare model (logits and refit only)."""
    from moerl.data.tokenizer import build_tokenizer
    from moerl.lora.peft_lora import apply_lora
    from moerl.models.presets import build_model
    from moerl.refit.loaders import BaseLoader
    from moerl.refit.adapter_format import AdapterMap

    tok = build_tokenizer()
    model = build_model(cfg.model, tok, seed=cfg.seed)
    if mode == "adapter":
        model = apply_lora(model, cfg.lora, cfg.model.preset)
    BaseLoader(model).load(base, strict=True)
    if adapter is not None:
        AdapterMap(model).load(adapter)
    try:
        from moerl.rollout.hf import HFEngine
    except ImportError:
        HFEngine = None
    if HFEngine is not None:
        engine = HFEngine(model, tok, cfg.rollout, cfg.data.task)
        return engine, engine.model
    dtype = compute_dtype(cfg.rollout.dtype)
    model = model.to(dtype).eval().requires_grad_(False)
    return None, model


def _worker(conn, cfg, mode: str, base: dict, adapter: dict | None, threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        engine, model = _build_engine(cfg, mode, base, adapter)
        from moerl.refit.loaders import make_apply

        receiver = Receiver(make_apply(model, mode))
        del base, adapter
        conn.send(("ok", None))
    except Exception:  # noqa: BLE001 - report any start-up failure to the parent, then exit
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        op = msg[0]
        try:
            if op == "stage":
                _, version, index, expected = msg
                # The acknowledgement names version and bucket: the parent drops those of a refit it gave up on.
                try:
                    receiver.stage(version, index, None, expected)  # checked where the trainer packed it
                    conn.send(("bucket", version, index, None))
                except RefitError as err:
                    conn.send(("bucket", version, index, (type(err).__name__, str(err))))
                continue
            if op == "plan":
                _, plan, staging = msg
                receiver.set_plan(plan, staging)
                out: Any = None
            elif op == "commit":
                try:
                    out = receiver.commit(msg[1])
                except (RefitError, ValueError) as err:
                    conn.send(("refit_error", type(err).__name__, str(err)))
                    continue
            elif op == "logits":
                with torch.no_grad():
                    ids, mask = msg[1], msg[2]
                    out = model(input_ids=ids, attention_mask=mask).logits.float()
            elif op == "ping":  # round-trip cost of one message (the benchmark's fixed cost)
                out = None
            elif op == "effective":
                from moerl.refit.weights import effective_state_dict

                out = {k: v.float().clone() for k, v in effective_state_dict(model).items()}
            elif op == "generate":
                if engine is None:
                    raise RuntimeError("generate needs moerl.rollout.hf.HFEngine, which failed to import")
                out = engine.generate(*msg[1], **msg[2])
            elif op == "close":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"engine process: unknown request '{op}'")
            conn.send(("ok", out))
        except Exception:  # noqa: BLE001 - the parent raises it with the worker's traceback
            conn.send(("error", traceback.format_exc()))


class EngineProcess:
    """Client handle of the out-of-process engine; also the refit transport for ``Refitter``.

    ``policy`` is the trainer's (PEFT) model: its base weights (and adapter, in adapter mode) are the
    engine's starting weights, sent once at start-up through shared memory."""

    def __init__(self, cfg, policy: torch.nn.Module, mode: str | None = None, threads: int = 1,
                 timeout: float = 300.0):
        from moerl.refit.adapter_format import canonical_adapter
        from moerl.refit.weights import effective_state_dict, base_state_dict

        self.mode = mode or cfg.refit.mode
        self.timeout = timeout
        dtype = compute_dtype(cfg.rollout.dtype)
        if self.mode == "adapter":
            base = base_state_dict(policy, dtype)
            adapter = {k: v.to(dtype).clone() for k, v in canonical_adapter(policy).items()}
        else:
            base, adapter = effective_state_dict(policy, dtype), None
        self._conn, child = _CTX.Pipe()
        self._proc = _CTX.Process(target=_worker, args=(child, cfg, self.mode, base, adapter, threads), daemon=True)
        self._proc.start()
        child.close()
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._plan: TransferPlan | None = None
        self._pending: list[int] = []  # buckets sent, ack not yet read
        self._version = 0
        self._errors: list[tuple[str, str]] = []  # (error class, message) of refused buckets
        self._recv("engine start-up")

    # -- plumbing ------------------------------------------------------------------------------
    def _recv(self, what: str, bucket_ack: bool = False):
        """The next reply; with ``bucket_ack``, the next acknowledgement of a pending bucket of the
        current refit. Bucket acknowledgements nobody waits for (a refit given up on after a timeout,
        whose buckets arrive late) are dropped, so they are never taken for another request's reply."""
        while True:
            if not self._conn.poll(self.timeout):
                raise TimeoutError(f"engine process: no answer to {what} within {self.timeout:.0f} s")
            try:
                reply = self._conn.recv()
            except EOFError:
                self._proc.join(5)
                raise RuntimeError(f"engine process died during {what} (exit code {self._proc.exitcode})") from None
            if reply[0] == "error":
                raise RuntimeError(f"engine process failed on {what}:\n{reply[1]}")
            if reply[0] != "bucket":
                return reply
            if bucket_ack and reply[1] == self._version and reply[2] in self._pending:
                return reply

    def _call(self, *msg):
        self._conn.send(msg)
        return self._recv(msg[0])[1]

    # -- requests ------------------------------------------------------------------------------
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._call("logits", input_ids, attention_mask)

    def ping(self) -> None:
        self._call("ping")

    def effective_state_dict(self) -> dict[str, torch.Tensor]:
        return self._call("effective")

    def generate(self, questions, answers, group_size: int, **kwargs):
        return self._call("generate", (questions, answers, group_size), kwargs)

    # -- transport (used by Refitter) ----------------------------------------------------------
    def prepare(self, plan: TransferPlan) -> None:
        if self._staging.numel() < plan.total_bytes:
            self._staging = new_staging(plan, shared=True)
        self._plan = plan
        self._call("plan", plan, self._staging)

    def buffer(self, index: int) -> torch.Tensor:
        # Each bucket has its own region, rewritten only by the next refit, which starts after this
        # one's commit has read every ack: no waiting here, packing runs ahead of the worker's checks.
        return bucket_region(self._staging, self._plan.buckets[index])

    def send(self, version: int, index: int, checksum: int) -> None:
        self._version = version
        self._conn.send(("stage", version, index, checksum))
        self._pending.append(index)
        while self._pending and self._conn.poll(0):  # keep the ack pipe drained (no back-pressure stall)
            self._read_ack()

    def _await(self, waiting, version) -> None:
        """Read acks while ``waiting()``; a bucket never acknowledged (lost on the way) is named."""
        try:
            while waiting():
                self._read_ack()
        except TimeoutError:
            lost, self._pending, self._errors = list(self._pending), [], []
            raise RefitError(f"refit {version}: bucket(s) {lost} sent but never acknowledged by the engine process "
                             f"within {self.timeout:.0f} s (lost on the way); nothing committed, the engine keeps "
                             f"the previous weights") from None

    def _read_ack(self) -> None:
        """One bucket's acknowledgement, matched by the version and bucket index it carries (not by
        arrival order: a bucket lost on the way must not make the next one's ack look like its own)."""
        _, _, index, error = self._recv(f"bucket(s) {self._pending}", bucket_ack=True)
        self._pending.remove(index)
        if error is not None:
            self._errors.append(error)

    def commit(self, version: int) -> int:
        self._await(lambda: bool(self._pending), version)
        errors, self._errors = self._errors, []
        self._conn.send(("commit", version))
        reply = self._recv("commit")
        if errors:  # the first failure is the cause; commit then refused the staged refit
            kind, message = errors[0]
            raise (CorruptBucketError if kind == "CorruptBucketError" else RefitError)(message)
        if reply[0] == "refit_error":
            raise RefitError(reply[2])
        return reply[1]

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
                self._conn.poll(10)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
