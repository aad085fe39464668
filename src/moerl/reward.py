"""Math reward by math-verify, safe outside the main thread.

math-verify's default timeouts use ``signal.alarm``, which only works in the main thread (and so
fails inside Ray actors, thread pools and DataLoader workers). We pass ``parsing_timeout=None`` and
``timeout_seconds=None`` and keep inputs short instead; results are cached because GRPO samples the
same completion for the same problem many times.
"""
from __future__ import annotations

import logging
from functools import lru_cache

import math_verify.parser
from math_verify import parse, verify

# We disable the alarm-based timeouts on purpose (see above); silence the per-call warning about it.
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_COMPLETION_CHARS = 2000  # bounds parse time without a signal-based timeout
PARSE_CACHE_SIZE = 1 << 16


def _enlarge_parse_caches() -> None:
    """Give math-verify's own LaTeX/expression parse caches room for a whole run's answers.

    math-verify memoises ``parse_latex_cached`` / ``parse_expr_cached`` (the sympy parse, ~1.5 ms a
    call, most of a reward's cost) with 20 entries, fewer than the distinct answers in one GRPO batch,
    so nearly every call misses. We re-wrap the same upstream functions in a larger LRU; the parser
    looks them up as module globals at call time, so results are the library's own, computed once.
    """
    for name in ("parse_latex_cached", "parse_expr_cached"):
        cached = getattr(math_verify.parser, name)
        if cached.cache_info().maxsize < PARSE_CACHE_SIZE:
            setattr(math_verify.parser, name, lru_cache(maxsize=PARSE_CACHE_SIZE)(cached.__wrapped__))


_enlarge_parse_caches()


@lru_cache(maxsize=1 << 16)
def _gold(answer: str):
    text = answer if "\\boxed" in answer or "$" in answer else f"\\boxed{{{answer}}}"
    return parse(text, parsing_timeout=None)


@lru_cache(maxsize=1 << 18)
def math_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals ``answer`` (math-verify semantics), else 0.0."""
    if not completion or "\\boxed" not in completion:
        return 0.0
    pred = parse(completion[-MAX_COMPLETION_CHARS:], parsing_timeout=None)
    if not pred:
        return 0.0
    try:
        return 1.0 if verify(_gold(answer), pred, timeout_seconds=None) else 0.0
    except Exception:  # math-verify raises on exotic sympy objects; an unverifiable answer earns nothing
        return 0.0


def batch_rewards(completions: list[str], answers: list[str]) -> list[float]:
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    return [math_reward(c, a) for c, a in zip(completions, answers)]
