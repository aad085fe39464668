"""Math reward by math-verify, safe outside the main thread.

math-verify's default timeouts use ``signal.alarm``, which only works in the main thread (and so
fails inside Ray actors, thread pools and DataLoader workers). We pass ``parsing_timeout=None`` and
``timeout_seconds=None`` and bound the work instead: inputs are kept short, and an answer whose value
would have more digits than any answer here (a collapsed policy writes ``\boxed{999^{99999999}}``) earns
nothing without being evaluated -- sympy would compute it in full inside one C call, which no
signal-based timeout interrupts, and the run would hang. Results are cached because GRPO samples the same
completion for the same problem many times.
"""
from __future__ import annotations

import logging
import math
from functools import lru_cache

import math_verify.parser
import sympy
from math_verify import parse, verify

# We disable the alarm-based timeouts on purpose (see above); silence the per-call warning about it.
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_COMPLETION_CHARS = 2000  # bounds parse time without a signal-based timeout
PARSE_CACHE_SIZE = 1 << 16
# An answer with more digits than this is never evaluated (it earns 0): the data's answers have a few
# digits, and sympy computes a power or factorial in full before comparing it (999^99999999: hours).
MAX_ANSWER_DIGITS = 10_000


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


def log10_magnitude(expr: sympy.Basic) -> float:
    """An upper bound on log10 |value| of a parsed (unevaluated) answer, from its integer powers and
    factorials, without evaluating it; inf when the bound itself is astronomically large. Symbols and
    other atoms count as small: only what sympy would multiply out in full is bounded.

    Written here because neither math-verify nor sympy bounds the size of what ``doit`` evaluates."""
    if isinstance(expr, sympy.Rational):  # Integer included
        return max(math.log10(abs(int(n))) if n else 0.0 for n in (expr.p, expr.q))
    if isinstance(expr, sympy.Pow):
        base, exponent = expr.args
        if isinstance(base, sympy.Integer) and abs(int(base)) <= 1:
            return 0.0  # 0, 1 and -1 to any power are resolved without computing it
        exponent_log10 = log10_magnitude(exponent)
        return math.inf if exponent_log10 > 300 else 10 ** exponent_log10 * log10_magnitude(base)
    if isinstance(expr, sympy.factorial):
        n_log10 = log10_magnitude(expr.args[0])
        return math.inf if n_log10 > 300 else 10 ** n_log10 * max(n_log10, 1.0)
    return sum((log10_magnitude(a) for a in expr.args), 0.0)


def too_large_to_evaluate(prediction: list) -> bool:
    """Whether any parsed form of a prediction has a value of more than MAX_ANSWER_DIGITS digits."""
    return any(log10_magnitude(p) > MAX_ANSWER_DIGITS for p in prediction if isinstance(p, sympy.Basic))


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
    if not pred or too_large_to_evaluate(pred):
        return 0.0
    try:
        return 1.0 if verify(_gold(answer), pred, timeout_seconds=None) else 0.0
    except Exception:  # math-verify raises on exotic sympy objects; an unverifiable answer earns nothing
        return 0.0


def batch_rewards(completions: list[str], answers: list[str]) -> list[float]:
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    return [math_reward(c, a) for c, a in zip(completions, answers)]
