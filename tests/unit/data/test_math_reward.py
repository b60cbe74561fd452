"""The math reward (math-verify) on boxed / LaTeX / numeric answers, also from a worker thread."""

import threading

import pytest

from miles.data.math_reward import format_reward, math_reward
from miles.data.rewards import RewardScorer, get_reward_fn


@pytest.mark.parametrize(("response", "label", "expected"), [
    ("so the answer is \\boxed{42}", "42", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0),
    ("we get $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
    ("\\boxed{1 + x^2}", "x^2+1", 1.0),
    ("The answer is 42.", "42", 1.0),  # no \boxed: math-verify finds the last answer
    ("first \\boxed{7}, then corrected: \\boxed{42}", "42", 1.0),  # the last \boxed counts
    ("first \\boxed{42}, then corrected: \\boxed{7}", "42", 0.0),
    ("so the answer is \\boxed{41}", "42", 0.0),
    ("I don't know", "42", 0.0),
    ("", "42", 0.0),
])
def test_math_reward(response, label, expected):
    assert math_reward(response, label) == expected


def test_math_reward_works_from_a_worker_thread():
    # math-verify's SIGALRM timeouts raise off the main thread; the reward must not depend on them.
    out = []
    thread = threading.Thread(target=lambda: out.append(math_reward("\\boxed{\\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join()
    assert out == [1.0]
    # ... and through the scorer's thread pool, as a user function that calls it would be.
    scorer = RewardScorer(lambda response, label: math_reward(response, label), timeout_s=30)
    assert scorer.score([("\\boxed{42}", "42", {}), ("\\boxed{4}", "42", {})]) == ([1.0, 0.0], 0)


def test_math_is_a_builtin_run_inline():
    scorer = RewardScorer(get_reward_fn("math"))
    assert scorer.inline and scorer.score([("\\boxed{3}", "3", {"prompt": "1+2="})]) == ([1.0], 0)


@pytest.mark.parametrize(("response", "expected"), [
    ("so \\boxed{42}", 1.0),
    ("3 + 4 = 7\n#### 7", 1.0),
    ("the answer is 42", 0.0),
    ("\\boxed{unclosed", 0.0),
    ("", 0.0),
])
def test_format_reward(response, expected):
    assert format_reward(response, "ignored") == expected
