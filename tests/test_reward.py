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
