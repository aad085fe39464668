"""Math reward by math-verify, safe outside the main thread.

math-verify's default timeouts use ``signal.alarm``, which only works in the main thread (and so
fails inside Ray actors, thread pools and DataLoader workers). We pass ``parsing_timeout=None`` and
``timeout_seconds=None`` and bound the work instead -- a signal could not stop sympy inside one C call
anyway, and a collapsed policy's answers reach such calls (``\boxed{999^{99999999}}`` computes the power
in full: hours):

- inputs are kept short;
- a number with more digits than any answer here earns 0 without being evaluated (a static bound, the
  same on every machine);
- parsing and verifying run in a worker process that is killed when one answer takes over
  ``VERIFY_TIMEOUT_SECONDS`` (earning 0 then): what no bound foresees -- ``(x+y+1)^{1000}`` is expanded
  for minutes, ``\binom{99999999}{49999999}`` is evaluated while parsing -- cannot stop a run. Ordinary
  answers take milliseconds, so the limit is never near them;
- a batch's answers together get ``BATCH_TIMEOUT_SECONDS``: a batch of many slow answers, each under
  its own limit, cannot stall a step for minutes (the answers left when it runs out earn 0, logged);
- the worker dies with the process that started it (a parent-death signal, and a watchdog on the parent's
  pid), so a trainer killed with ``kill -9`` leaves no worker computing on.

Results are cached because GRPO samples the same completion for the same problem many times.
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
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
# One answer's parse and verification is stopped after this long (it earns 0); ordinary ones take milliseconds.
VERIFY_TIMEOUT_SECONDS = 20.0
# All answers of one batch together: a step's ordinary answers take well under a second.
BATCH_TIMEOUT_SECONDS = 60.0
WORKER_START_SECONDS = 120.0  # importing math-verify and sympy; on a loaded machine, seconds
log = logging.getLogger(__name__)


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


COMBINATORIAL = (sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.binomial, sympy.RisingFactorial,
                 sympy.FallingFactorial)


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
    if isinstance(expr, COMBINATORIAL):  # n!, n!!, !n, C(n, k), rising / falling factorials: <= m^m, m the largest argument
        m_log10 = max(log10_magnitude(a) for a in expr.args)
        return math.inf if m_log10 > 300 else 10 ** m_log10 * max(m_log10, 1.0)
    return sum((log10_magnitude(a) for a in expr.args), 0.0)


def too_large_to_evaluate(prediction: list) -> bool:
    """Whether any parsed form of a prediction has a value of more than MAX_ANSWER_DIGITS digits."""
    return any(log10_magnitude(p) > MAX_ANSWER_DIGITS for p in prediction if isinstance(p, sympy.Basic))


@lru_cache(maxsize=1 << 16)
def _gold(answer: str):
    text = answer if "\\boxed" in answer or "$" in answer else f"\\boxed{{{answer}}}"
    return parse(text, parsing_timeout=None)


def reward_in_process(completion_tail: str, answer: str) -> float:
    """math-verify's verdict on a completion's tail, in this process (what the worker runs): a number too
    large to evaluate earns 0 at once, the same on every machine."""
    pred = parse(completion_tail, parsing_timeout=None)
    if not pred or too_large_to_evaluate(pred):
        return 0.0
    try:
        return 1.0 if verify(_gold(answer), pred, timeout_seconds=None) else 0.0
    except Exception:  # math-verify raises on exotic sympy objects; an unverifiable answer earns nothing
        return 0.0


class IsolatedVerifier:
    """``reward_in_process`` in a child process that is killed when one answer takes over ``timeout`` s.

    A plain ``python -c`` child reading JSON lines, written here because multiprocessing's spawn and
    forkserver re-import the caller's main module (which breaks inside Ray workers and unguarded
    scripts) and fork would copy the trainer's threads; pebble's pool builds on those contexts."""

    def __init__(self, timeout: float, batch_timeout: float | None = None):
        self.timeout, self.process, self.lock = timeout, None, threading.Lock()
        self.batch_timeout = BATCH_TIMEOUT_SECONDS if batch_timeout is None else batch_timeout

    def _start(self) -> subprocess.Popen:
        # the parent-death signal follows the thread that started the child: asked for from the main thread
        # only (a worker thread that ends would kill a worker its process still uses); the watchdog always
        signal_death = threading.current_thread() is threading.main_thread()
        code = (f"import sys; sys.path[:0] = {sys.path!r}; from moerl.reward import serve; "
                f"serve(handshake=True, parent={os.getpid()}, parent_death_signal={signal_death})")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # unbuffered bytes: select() sees every reply line, none hides in a read-ahead buffer
        process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   env=env, bufsize=0)
        atexit.register(process.kill)
        # A worker that cannot start is a broken set-up, not an answer's fault: say so instead of scoring 0.
        ready, _, _ = select.select([process.stdout], [], [], WORKER_START_SECONDS)
        if not ready or process.stdout.readline() != b"ready\n":
            process.kill()
            raise RuntimeError(f"moerl.reward: the verifier worker did not start within {WORKER_START_SECONDS:g} s "
                               f"(exit code {process.poll()}; its stderr is above); rewards cannot be computed")
        return process

    def __call__(self, completion_tail: str, answer: str) -> float:
        return self.many([(completion_tail, answer)])[0]

    def many(self, pairs: list[tuple[str, str]], chunk_bytes: int = 32 << 10) -> list[float]:
        """Rewards of (completion tail, answer) pairs, in order. A chunk is written at once (one round trip,
        not one per answer) and read back line by line, each answer with its own time limit: one that
        exceeds it earns 0, its worker is killed, and the answers after it go to a new worker; once the
        batch has taken ``batch_timeout`` s in all (worker starts aside), the answers left earn 0. A chunk
        fits in the pipe's buffer (64 KiB), so writing it never waits on a worker that hangs."""
        out: list[float] = []
        lines = [(json.dumps(pair) + "\n").encode() for pair in pairs]
        with self.lock:
            deadline = time.monotonic() + self.batch_timeout
            while len(out) < len(pairs):
                if time.monotonic() >= deadline:
                    left = len(pairs) - len(out)
                    log.warning("reward: the batch's %d answers took over %g s together; the %d not yet verified "
                                "earn 0 (first: %r)", len(pairs), self.batch_timeout, left, pairs[len(out)][0][-80:])
                    out += [0.0] * left
                    break
                todo, size = [], 0
                for line in lines[len(out):]:
                    if todo and size + len(line) > chunk_bytes:
                        break
                    todo.append(pairs[len(out) + len(todo)])
                    size += len(line)
                if self.process is None or self.process.poll() is not None:
                    began = time.monotonic()
                    self.process = self._start()
                    deadline += time.monotonic() - began  # starting a worker is not the answers' time
                self.process.stdin.write(b"".join(lines[len(out):len(out) + len(todo)]))
                for tail, _ in todo:
                    left = deadline - time.monotonic()
                    ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, min(self.timeout, left)))
                    line = self.process.stdout.readline() if ready else b""
                    if not line:  # took too long, or died on this answer: kill it, the rest go to a new one
                        self.process.kill()
                        self.process.wait()
                        self.process = None
                        if not ready and left <= self.timeout:  # the batch's budget ran out, not the answer's
                            break
                        why = f"took over {self.timeout:g} s" if not ready else "ended its verifier (killed, out of memory?)"
                        log.warning("reward: verifying %r %s; it earns 0", tail[-80:], why)
                        out.append(0.0)
                        break
                    out.append(float(line))
        return out


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int, signal_death: bool = True, poll_seconds: float = 1.0) -> None:
    """End this process when process ``parent`` ends: on Linux a parent-death SIGKILL from the kernel
    (``prctl(PR_SET_PDEATHSIG)``, through ctypes: no library wraps it; it fires even while this process is
    inside one long C call), and everywhere a daemon thread that exits once this process's parent pid is no
    longer ``parent`` (the parent died and this process was re-parented)."""
    import signal

    if signal_death and sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the watchdog below still ends it
            pass
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def serve(handshake: bool = False, parent: int | None = None, parent_death_signal: bool = True) -> None:
    """The worker's loop: one JSON ``[completion_tail, answer]`` per line in, its reward per line out (on
    the real stdout only: anything a library prints goes to stderr, so it cannot be read as a reward);
    ``handshake``: first a ``ready`` line once its imports are done; ``parent``: the pid whose death ends
    this worker (``die_with_parent``)."""
    if parent is not None:
        die_with_parent(parent, parent_death_signal)
    replies, sys.stdout = sys.stdout, sys.stderr
    if handshake:
        replies.write("ready\n")
        replies.flush()
    for line in sys.stdin:
        replies.write(f"{reward_in_process(*json.loads(line))}\n")
        replies.flush()


class InProcessVerifier:
    """``reward_in_process`` behind the worker's interface, with no time limit: for a benchmark whose
    comparison patches this process's parser (``in_process``), never for a run."""

    def __call__(self, completion_tail: str, answer: str) -> float:
        return reward_in_process(completion_tail, answer)

    def many(self, pairs: list[tuple[str, str]]) -> list[float]:
        return [reward_in_process(*pair) for pair in pairs]


verifier: IsolatedVerifier | InProcessVerifier = IsolatedVerifier(VERIFY_TIMEOUT_SECONDS)
# the answers already verified: GRPO samples the same completion for the same problem many times
CACHE_SIZE = 1 << 18
_cache: OrderedDict[tuple[str, str], float] = OrderedDict()


def clear_cache() -> None:
    _cache.clear()


@contextmanager
def in_process():
    """Verify in this process while the block runs (and with an empty cache on both sides of it)."""
    global verifier
    saved, verifier = verifier, InProcessVerifier()
    clear_cache()
    try:
        yield
    finally:
        verifier = saved
        clear_cache()


def _scored(completion: str) -> bool:
    return bool(completion) and "\\boxed" in completion


def boxed_from_hashes(completion: str) -> str:
    """A GSM8K-style completion (``... #### 42``) with its final answer boxed (``\\boxed{42}``), so math-verify
    reads it as it reads the boxed answers; a completion that boxes its answer itself is left as it is.
    verl's GSM8K scorer reads the text after the last ``####`` the same way (verl/utils/reward_score/gsm8k.py)."""
    if "\\boxed" in completion or "####" not in completion:
        return completion
    tail = completion.rsplit("####", 1)[1].strip().split("\n")[0].strip().replace(",", "").rstrip(".")
    return f"{completion}\n\\boxed{{{tail}}}" if tail else completion


def math_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals ``answer`` (math-verify semantics), else 0.0."""
    return batch_rewards([completion], [answer])[0]


def math_reward_uncached(completion: str, answer: str) -> float:
    """``math_reward`` without this module's cache (a benchmark's other side keeps a cache of its own)."""
    return verifier(completion[-MAX_COMPLETION_CHARS:], answer) if _scored(completion) else 0.0


def batch_rewards(completions: list[str], answers: list[str], hashes: bool = False) -> list[float]:
    """``math_reward`` of each pair; the pairs not seen before go to the worker together. ``hashes``: a
    final answer after ``####`` counts too (GSM8K's format, asked for by verl's GSM8K instruction)."""
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    if hashes:
        completions = [boxed_from_hashes(c) for c in completions]
    keys = [(c[-MAX_COMPLETION_CHARS:], a) if _scored(c) else None for c, a in zip(completions, answers)]
    unseen = list(dict.fromkeys(k for k in keys if k is not None and k not in _cache))
    _cache.update(zip(unseen, verifier.many(unseen)))
    rewards = [0.0 if k is None else _cache[k] for k in keys]
    while len(_cache) > CACHE_SIZE:  # forget the oldest answers, one O(1) pop each
        _cache.popitem(last=False)
    return rewards
