import threading

from moerl.reward import IsolatedVerifier, batch_rewards, math_reward, reward_in_process


def test_math_verify_semantics():
    assert math_reward("\\boxed{24}", "24") == 1.0
    assert math_reward("\\boxed{25}", "24") == 0.0
    assert math_reward("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert math_reward("24", "24") == 0.0  # no boxed answer, no reward
    assert math_reward("", "1") == 0.0


def test_reward_works_outside_the_main_thread():
    out = []
    worker = threading.Thread(target=lambda: out.append(batch_rewards(["\\boxed{7}", "\\boxed{8}"], ["7", "7"])))
    worker.start()
    worker.join()
    assert out == [[1.0, 0.0]]


def test_parse_cache_holds_a_batch_of_distinct_answers():
    """math-verify's own parse cache (20 entries) would miss on every one of 200 distinct answers;
    enlarged, a second pass over them parses nothing and gives the same rewards."""
    import math_verify.parser

    completions = [f"12+{i}=\\boxed{{{12 + i}}}" for i in range(200)]
    answers = [str(12 + i) if i % 3 else str(i) for i in range(200)]
    first = [reward_in_process(c, a) for c, a in zip(completions, answers)]
    misses = math_verify.parser.parse_latex_cached.cache_info().misses
    again = [reward_in_process(c, a) for c, a in zip(completions, answers)]
    assert again == first and sum(first) == 133
    assert math_verify.parser.parse_latex_cached.cache_info().misses == misses


def test_an_answer_too_large_to_evaluate_earns_nothing_without_hanging():
    """A collapsed policy wrote an answer like ``\\boxed{999^{99999999}}``: math-verify hands it to sympy,
    which computes the power in full inside one C call (hours; no signal-based timeout interrupts it) and
    the run hung. Each such number now earns 0 by a static bound, before the worker's time limit, in
    process; run in a child process so that a regression fails here instead of hanging the suite."""
    import subprocess
    import sys

    huge = [r"\boxed{999^{99999999}}", r"\boxed{9^{9^{9}}}", r"\boxed{100000000!}", r"\boxed{2^{-99999999}}",
            r"so the answer is \boxed{3 \cdot 7^{99999999} + 1}"]
    code = ("import sys; from moerl.reward import reward_in_process; "
            f"print([reward_in_process(c, '5') for c in {huge!r}])")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("math_reward did not return on an answer too large to evaluate") from None
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([0.0] * len(huge))


def test_an_answer_that_outlasts_its_time_limit_earns_nothing_and_the_rest_are_verified():
    """What no static bound foresees is stopped by the worker's time limit: a symbolic power sympy expands
    for minutes, a binomial that parsing itself evaluates. The answer earns 0, its worker is killed, and
    the answers after it (in the same chunk) are verified by a new worker, in order."""
    import time

    verifier = IsolatedVerifier(timeout=3.0)
    pairs = [(r"\boxed{7}", "7"), (r"\boxed{(x+y+1)^{1000}}", "5"), (r"\boxed{8}", "8"),
             (r"\boxed{\binom{99999999}{49999999}}", "5"), (r"\boxed{9}", "7")]
    start = time.perf_counter()
    assert verifier.many(pairs) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert time.perf_counter() - start < 60
    assert verifier(r"\boxed{0.5}", "\\frac{1}{2}") == 1.0  # the worker after a kill is a working one


def test_batch_rewards_match_one_by_one_and_reuse_what_they_verified(monkeypatch):
    import moerl.reward as reward

    completions = [f"3*{i}=\\boxed{{{3 * i}}}" for i in range(50)] * 3 + ["no box", ""]
    answers = [str(3 * i) if i % 4 else str(i + 1) for i in range(50)] * 3 + ["1", "1"]
    expected = [reward_in_process(c, a) if "\\boxed" in c else 0.0 for c, a in zip(completions, answers)]
    sent = []
    many = reward.verifier.many
    monkeypatch.setattr(reward.verifier, "many", lambda pairs: sent.append(len(pairs)) or many(pairs))
    assert batch_rewards(completions, answers) == expected
    assert batch_rewards(completions, answers) == expected
    assert sent == [50, 0]  # each distinct pair verified once
    with reward.in_process():  # a benchmark's side that patches this process's parser
        assert isinstance(reward.verifier, reward.InProcessVerifier)
        assert batch_rewards(completions, answers) == expected
    assert isinstance(reward.verifier, IsolatedVerifier)


def test_large_but_ordinary_answers_are_still_verified():
    from moerl.reward import MAX_ANSWER_DIGITS, log10_magnitude, too_large_to_evaluate
    from math_verify import parse

    assert math_reward(r"\boxed{2^{100}}", str(2 ** 100)) == 1.0  # 31 digits, computed and compared
    assert math_reward(r"\boxed{10^{3} \cdot 3}", "3000") == 1.0
    assert math_reward(r"\boxed{1^{99999999}}", "1") == 1.0  # 1, 0 and -1 to any power cost nothing
    assert math_reward(r"\boxed{(-1)^{99999999}}", "-1") == 1.0
    # the bound: 7^5000 has 4,226 digits (evaluated), 7^50000 has 42,255 (not)
    assert not too_large_to_evaluate(parse(r"\boxed{7^{5000}}", parsing_timeout=None))
    assert too_large_to_evaluate(parse(r"\boxed{7^{50000}}", parsing_timeout=None))
    assert abs(log10_magnitude(parse(r"\boxed{7^{5000}}", parsing_timeout=None)[0]) - len(str(7 ** 5000))) < 1
    assert MAX_ANSWER_DIGITS >= 1000


def test_every_answer_of_the_generated_data_is_far_below_the_bound():
    from moerl.data.synthetic import arith_splits, worked_splits
    from moerl.reward import MAX_ANSWER_DIGITS

    for splits in (arith_splits(2000, 500, seed=0), worked_splits(2000, 500, seed=0)):
        answers = [row["answer"] for split in splits for row in split]
        assert max(len(a) for a in answers) < MAX_ANSWER_DIGITS / 100


def test_a_verifier_worker_that_cannot_start_is_an_error_not_a_zero_reward(monkeypatch):
    """An answer that kills or outlasts its worker earns 0; a worker that never starts (a broken set-up)
    would otherwise score every answer 0 in silence, so it raises, naming the cause."""
    import pytest

    import moerl.reward as reward

    verifier = IsolatedVerifier(timeout=5.0)
    monkeypatch.setattr(reward, "WORKER_START_SECONDS", 30.0)
    monkeypatch.setattr(reward.sys, "executable", "/bin/false")  # a child that exits at once
    with pytest.raises(RuntimeError, match="verifier worker did not start"):
        verifier(r"\boxed{7}", "7")


def test_the_reward_cache_keeps_the_newest_answers_within_its_size(monkeypatch):
    import moerl.reward as reward

    monkeypatch.setattr(reward, "CACHE_SIZE", 5)
    with reward.in_process():
        rewards = batch_rewards([f"\\boxed{{{i}}}" for i in range(8)], [str(i) for i in range(8)])
        assert rewards == [1.0] * 8  # every answer scored before the oldest are forgotten
        assert list(reward._cache) == [(f"\\boxed{{{i}}}", str(i)) for i in range(3, 8)]


def test_a_batch_of_slow_answers_stops_at_its_total_time_budget(caplog):
    """Each slow answer is stopped at its own limit, and the batch as a whole at its budget: the answers
    left when it runs out earn 0 unverified, with a warning, instead of each taking its full limit."""
    import logging
    import time

    verifier = IsolatedVerifier(timeout=2.0, batch_timeout=3.0)
    slow = (r"\boxed{(x+y+1)^{1000}}", "5")
    verifier(r"\boxed{1}", "1")  # a started worker: its start is not part of the budget
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="moerl.reward"):
        assert verifier.many([(r"\boxed{7}", "7"), slow, slow, slow, slow, (r"\boxed{8}", "8")]) == [1.0] + [0.0] * 5
    assert time.perf_counter() - start < 3.0 + 15  # the budget, and at most one worker restart on a busy machine
    assert "the batch's 6 answers took over 3 s together; the 4 not yet verified earn 0" in caplog.text


def test_the_verifier_worker_dies_with_its_parent(tmp_path):
    """A trainer killed with kill -9 while its worker verifies a slow answer leaves no worker behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "from moerl.reward import IsolatedVerifier\n"
        "v = IsolatedVerifier(timeout=600.0)\n"
        "v.process = v._start()\n"
        "print(v.process.pid, flush=True)\n"
        "v.many([(r'\\boxed{(x+y+1)^{1000}}', '5')])\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    worker = int(parent.stdout.readline())
    time.sleep(1.0)  # the worker is inside the slow answer
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def alive(pid: int) -> bool:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state not in ("Z", "X")

    deadline = time.time() + 10
    while alive(worker) and time.time() < deadline:
        time.sleep(0.1)
    if alive(worker):
        os.kill(worker, signal.SIGKILL)
        raise AssertionError(f"verifier worker {worker} outlived its parent")
