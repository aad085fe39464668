import threading

from moerl.reward import batch_rewards, math_reward


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
    first = [math_reward.__wrapped__(c, a) for c, a in zip(completions, answers)]
    misses = math_verify.parser.parse_latex_cached.cache_info().misses
    again = [math_reward.__wrapped__(c, a) for c, a in zip(completions, answers)]
    assert again == first and sum(first) == 133
    assert math_verify.parser.parse_latex_cached.cache_info().misses == misses
