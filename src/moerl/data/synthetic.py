"""Seeded synthetic math: ``a+b*c=`` with the answer in ``\\boxed{}``, and a worked multi-step variant.

Small enough that a 2M-parameter MoE learns it in minutes on a CPU, hard enough (operator
precedence, carries) that accuracy starts well below 100 % and GRPO has something to improve.
Train and test splits are disjoint by construction (test problems are drawn first and excluded).
"""
from __future__ import annotations

import random


def arith_problem(rng: random.Random, max_a: int, max_bc: int) -> tuple[str, str]:
    a, b, c = rng.randint(0, max_a), rng.randint(0, max_bc), rng.randint(0, max_bc)
    return f"{a}+{b}*{c}=", str(a + b * c)


def arith_splits(train_size: int, test_size: int, seed: int, max_a: int = 99, max_bc: int = 9):
    """(train, test) lists of {"question", "answer"}; test is a set of distinct held-out problems."""
    space = (max_a + 1) * (max_bc + 1) ** 2
    if test_size >= space:
        raise ValueError(f"data.test_size={test_size} leaves no training problems (only {space} exist)")
    rng = random.Random(seed)
    test: dict[str, str] = {}
    while len(test) < test_size:
        q, a = arith_problem(rng, max_a, max_bc)
        test[q] = a
    train = []
    while len(train) < train_size:
        q, a = arith_problem(rng, max_a, max_bc)
        if q not in test:
            train.append({"question": q, "answer": a})
    return train, [{"question": q, "answer": a} for q, a in test.items()]


def worked_problem(rng: random.Random, max_a: int, max_bc: int) -> tuple[str, str, str]:
    """``a+b*c-d=`` answered step by step: ``b*c=p;a+p=q;q-d=r;\\boxed{r}`` (question, answer, target).

    The worked solution makes every answer 25-33 tokens long (character tokenizer): the mismatch compounds
    over the tokens of a response, and a response of ~8 tokens (``arith``) gives it little room. Each step
    is one the tiny model can learn, so a warm start reaches non-trivial accuracy."""
    a = rng.randint(min(10, max_a), max_a)  # two-digit a: every worked answer is >= 24 tokens
    b, c, d = rng.randint(0, max_bc), rng.randint(0, max_bc), rng.randint(0, max_bc)
    p = b * c
    q = a + p
    r = q - d
    return f"{a}+{b}*{c}-{d}=", str(r), f"{b}*{c}={p};{a}+{p}={q};{q}-{d}={r};\\boxed{{{r}}}"


def worked_splits(train_size: int, test_size: int, seed: int, max_a: int = 99, max_bc: int = 9):
    """(train, test) lists of {"question", "answer", "target"} for the worked task; test held out."""
    space = (max_a + 1 - min(10, max_a)) * (max_bc + 1) ** 3
    if test_size >= space:
        raise ValueError(f"data.test_size={test_size} leaves no training problems (only {space} exist)")
    rng = random.Random(seed)
    test: dict[str, tuple[str, str]] = {}
    while len(test) < test_size:
        q, a, t = worked_problem(rng, max_a, max_bc)
        test[q] = (a, t)
    train = []
    while len(train) < train_size:
        q, a, t = worked_problem(rng, max_a, max_bc)
        if q not in test:
            train.append({"question": q, "answer": a, "target": t})
    return train, [{"question": q, "answer": a, "target": t} for q, (a, t) in test.items()]


def worked_calibration_rows(size: int, seed: int, train: list[dict], test: list[dict], max_a: int = 99,
                            max_bc: int = 9) -> list[dict]:
    """``size`` distinct worked problems that are in neither split: a calibration set kept apart from the
    held-out evaluation (and from every problem the warm start or GRPO trains on), so that a choice made on
    it is not scored again on the same problems. Drawn from its own generator, ``Random(f"calibration-{seed}")``."""
    seen = {r["question"] for r in train} | {r["question"] for r in test}
    space = (max_a + 1 - min(10, max_a)) * (max_bc + 1) ** 3
    if size > space - len(seen):
        raise ValueError(f"calibration size={size}: only {space - len(seen)} problems lie outside both splits")
    rng = random.Random(f"calibration-{seed}")
    rows: dict[str, tuple[str, str]] = {}
    while len(rows) < size:
        q, a, t = worked_problem(rng, max_a, max_bc)
        if q not in seen:
            rows[q] = (a, t)
    return [{"question": q, "answer": a, "target": t} for q, (a, t) in rows.items()]
