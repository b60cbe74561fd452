"""User reward functions by dotted path, async rewards, and failures that score 0 and are counted."""

import asyncio
import sys
import time

import pytest

from miles.data.rewards import RewardScorer, exact_match, get_reward_fn


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def contains(response, label, **info):\n"
        "    return float(label in response)\n"
        "async def slow_async(response, label, **info):\n"
        "    import asyncio\n"
        "    await asyncio.sleep(0.01)\n"
        "    return len(info['prompt'])\n"
        "NOT_A_FUNCTION = 3\n")
    monkeypatch.chdir(tmp_path)  # a user's module in the working directory
    yield
    sys.modules.pop("my_rewards", None)


def test_dotted_paths_resolve_to_the_users_function(user_module):
    assert get_reward_fn("exact_match") is exact_match
    fn = get_reward_fn("my_rewards.contains")
    assert fn("the answer is 42", "42") == 1.0 and fn("41", "42") == 0.0


@pytest.mark.parametrize("spec,message", [
    ("nope", "unknown reward 'nope'"),
    ("no_such_module.fn", "cannot import it"),
    ("my_rewards.missing", "cannot import it"),
    ("my_rewards.NOT_A_FUNCTION", "is not a function"),
])
def test_bad_reward_specs_are_config_errors(user_module, spec, message):
    with pytest.raises(ValueError, match=message):
        get_reward_fn(spec)


def test_failures_score_zero_and_are_counted():
    def flaky(response, label, **info):
        if response == "raise":
            raise RuntimeError("boom")
        if response == "slow":
            time.sleep(1.0)
        if response == "nan":
            return float("nan")
        if response == "text":
            return "1.0"
        return 0.5

    scorer = RewardScorer(flaky, timeout_s=0.2)
    scores, errors = scorer.score([(r, "", {}) for r in ("ok", "raise", "slow", "nan", "text", "ok")])
    assert scores == [0.5, 0.0, 0.0, 0.0, 0.0, 0.5] and errors == 4
    assert scorer("ok", "") == 0.5


def test_async_rewards_run_concurrently_with_a_timeout(user_module):
    scorer = RewardScorer(get_reward_fn("my_rewards.slow_async"), timeout_s=1.0)
    start = time.perf_counter()
    scores, errors = scorer.score([("", "", {"prompt": "x" * k}) for k in range(50)])
    assert scores == [float(k) for k in range(50)] and errors == 0
    assert time.perf_counter() - start < 0.4  # 50 x 10 ms sleeps overlap

    async def hangs(response, label, **info):
        await asyncio.sleep(5)

    assert RewardScorer(hangs, timeout_s=0.05).score([("", "", {})] * 3) == ([0.0] * 3, 3)


def test_info_goes_only_to_functions_that_take_it():
    assert RewardScorer(lambda response, label: 1.0).score([("", "", {"prompt": "p"})]) == ([1.0], 0)
    assert RewardScorer(lambda response, label, prompt: float(prompt == "p")).score([("", "", {"prompt": "p"})]) == (
        [1.0], 0)


def test_builtins_run_inline_and_still_count_failures():
    scorer = RewardScorer(exact_match)
    assert scorer.inline and scorer.score([("42", "42", {}), ("4", "42", {}), (None, "42", {})]) == ([1.0, 0.0, 0.0], 1)
