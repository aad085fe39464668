"""Expert-bias side log: how far each trainer rank's router expert bias has moved from the checkpoint's.

DeepSeek-V3, Kimi-K2 and Moonlight route with an aux-loss-free expert bias (``e_score_correction_bias``
in their checkpoints; Megatron-Bridge turns ``moe_router_enable_expert_bias`` on for them). megatron-core
moves it after every step in ``finalize_model_grads`` unless ``moe_router_bias_update_rate`` is 0, and a
LoRA run neither sends it to vLLM again nor keeps it in its checkpoint, so a moved bias is routing the
trainer has and the rollout and a resume do not. The experiments freeze it (rule
``megatron.expert_bias_frozen_under_lora``); this log shows on the cluster that it stayed frozen.

Where the hook sits: verl 0.9.1 registers megatron-core's ``finalize_model_grads`` as each model's
``config.finalize_model_grads_func`` and imports it when it does so (``utils/megatron_utils.py:1726-1738``,
``from megatron.core.distributed import finalize_model_grads`` inside the function). ``install`` replaces
that package attribute with a wrapper, when the package is first imported (an import hook, so processes
that never import megatron-core do not load it), before any worker builds its model: the wrapper copies every
router's ``expert_bias`` on its first call (the value loaded from the checkpoint, before the first update),
calls megatron-core's function unchanged, then appends one JSON row: ``call`` (1 = step 1's first
gradient finalisation), ``rank`` (env ``RANK``), ``routers`` and ``max_abs_drift`` (largest |bias - loaded
bias| over this rank's routers). A module-level rebinding is the only way in: megatron-core exposes no
callback after the bias update and verl reads the function by name.

The log is ``X.expert_bias.jsonl`` beside the refit side log ``X.refit.jsonl`` (``moerl.verl_ext.refit_log``
installs this hook whenever it is installed itself); ``scripts/check_first_steps.py`` reads it
(``expert_bias_frozen``).
"""
from __future__ import annotations

import fcntl
import importlib.abc
import importlib.util
import json
import os
import sys
from pathlib import Path

SUFFIX = ".expert_bias.jsonl"
VERDICT = "expert_bias_frozen"


def beside(refit_log: str | Path) -> Path:
    """``X.expert_bias.jsonl`` for the refit side log ``X.refit.jsonl``."""
    p = Path(refit_log)
    name = p.name[: -len(".refit.jsonl")] if p.name.endswith(".refit.jsonl") else p.stem
    return p.with_name(name + SUFFIX)


def router_biases(model) -> list:
    """Every router ``expert_bias`` buffer of a model or a list of model chunks, in module order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m.expert_bias for c in chunks for m in c.modules() if getattr(m, "expert_bias", None) is not None]


def wrap(finalize, path: str | Path):
    """``finalize`` (megatron-core's ``finalize_model_grads``) that also appends a drift row to ``path``."""
    loaded: dict[int, list] = {}
    calls = {"n": 0}

    def finalize_model_grads(model, *args, **kwargs):
        key = id(model[0] if isinstance(model, (list, tuple)) and model else model)
        if key not in loaded:
            loaded[key] = [b.detach().float().cpu().clone() for b in router_biases(model)]
        result = finalize(model, *args, **kwargs)
        calls["n"] += 1
        now = router_biases(model)
        drift = max((float((b.detach().float().cpu() - b0).abs().max()) for b, b0 in zip(now, loaded[key])),
                    default=0.0)
        write_row(path, {"call": calls["n"], "rank": int(os.environ.get("RANK", 0)), "routers": len(now),
                         "max_abs_drift": drift})
        return result

    finalize_model_grads.moerl_wrapped = finalize
    return finalize_model_grads


TARGET = "megatron.core.distributed"


def _patch(module, path) -> None:
    if getattr(module.finalize_model_grads, "moerl_wrapped", None) is None:
        module.finalize_model_grads = wrap(module.finalize_model_grads, path)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Patches ``megatron.core.distributed`` right after it is first imported, so a process that never
    imports megatron-core (vLLM's workers import verl, and so this module) never loads it because of us."""

    def __init__(self, path):
        self.path = path

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # once, and the normal finders locate the package
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run, log = spec.loader.exec_module, self.path

        def exec_module(module):
            run(module)
            _patch(module, log)

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


def install(path: str | Path) -> bool:
    """Point ``megatron.core.distributed.finalize_model_grads`` at the logging wrapper: now if megatron-core
    is imported, else when it is (False: megatron-core is not installed here)."""
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET], path)
        return True
    if importlib.util.find_spec("megatron") is None:
        return False
    if not any(isinstance(f, _WrapOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport(path))
    return True


def write_row(path: str | Path, row: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def check(path: str | Path):
    """``expert_bias_frozen``: every logged gradient finalisation left every router's expert bias at the
    value loaded from the checkpoint."""
    from moerl.verl_ext.first_steps import RunReadError, Verdict

    p = Path(path)
    if not p.is_file():
        raise RunReadError(f"{p}: no expert-bias side log (the launcher writes it beside the refit side log)")
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise RunReadError(f"{p}:{i}: not a JSON row ({err})") from None
    with_bias = [r for r in rows if r.get("routers")]
    if not with_bias:
        return Verdict(VERDICT, bool(rows), f"{len(rows)} rows, no router with an expert bias" if rows else
                       f"{p}: empty: no gradient step was logged")
    moved = [r for r in with_bias if r["max_abs_drift"] > 0]
    if moved:
        r = moved[0]
        return Verdict(VERDICT, False, f"rank {r['rank']}'s router expert bias moved {r['max_abs_drift']:.3g} from "
                                       f"the checkpoint's by gradient step {r['call']} ({len(moved)} of "
                                       f"{len(with_bias)} rows moved): the trainer routes differently from vLLM "
                                       f"and from a resume; set override_transformer_config."
                                       f"moe_router_bias_update_rate=0")
    return Verdict(VERDICT, True, f"{len(with_bias)} rows over ranks {sorted({r['rank'] for r in with_bias})}, "
                                  f"up to step {max(r['call'] for r in with_bias)}: expert bias equal to the "
                                  f"checkpoint's")
