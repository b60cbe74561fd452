"""User reward functions by dotted path, async rewards, and failures that score 0 and are counted."""

import asyncio
import sys
import time
from types import SimpleNamespace

import pytest

from miles.config.schema import SandboxCfg, TaskCfg
from miles.config.rules import reward_problems
from miles.data.code_reward import extract_code
from miles.data.rewards import RewardScorer, WeightedSum, batched, build_scorer, exact_match, get_reward_fn

# Wall-clock limits and kills are asserted: make test runs this file alone, after the parallel part.
pytestmark = pytest.mark.serial


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def contains(response, label, **info):\n"
        "    return float(label in response)\n"
        "async def slow_async(response, label, **info):\n"
        "    import asyncio\n"
        "    await asyncio.sleep(0.01)\n"
        "    return len(info['prompt'])\n"
        "NOT_A_FUNCTION = 3\n"
        "def length(response, label):\n"
        "    return len(response)\n")
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


def test_batched_rewards_are_called_once_per_batch():
    calls = []

    @batched
    def lengths(responses, labels, infos):
        calls.append((responses, labels, infos))
        return [len(r) for r in responses]

    scorer = RewardScorer(lengths)
    assert scorer.score([("a", "x", {"prompt": "p"}), ("abc", "y", {"prompt": "q"})]) == ([1.0, 3.0], 0)
    assert calls == [(["a", "abc"], ["x", "y"], [{"prompt": "p"}, {"prompt": "q"}])]
    assert scorer.score([]) == ([], 0) and len(calls) == 1


def test_async_batched_rewards():
    @batched
    async def lengths(responses, labels, infos):
        await asyncio.sleep(0.01)
        return [len(r) for r in responses]

    assert RewardScorer(lengths).score([("ab", "", {}), ("", "", {})]) == ([2.0, 0.0], 0)


@pytest.mark.parametrize("result", ["raise", "short", "none", "slow", "slow_async"])
def test_a_failing_batched_call_scores_every_item_0_and_counts_them(result):
    def outcome(responses):
        if result == "raise":
            raise RuntimeError("boom")
        if result == "slow":
            time.sleep(1.0)
        return {"short": [1.0] * (len(responses) - 1), "none": None}.get(result, [1.0] * len(responses))

    @batched
    async def async_fn(responses, labels, infos):
        await asyncio.sleep(1.0)
        return [1.0] * len(responses)

    fn = async_fn if result == "slow_async" else batched(lambda responses, labels, infos: outcome(responses))
    start = time.perf_counter()
    assert RewardScorer(fn, timeout_s=0.2).score([("a", "", {})] * 3) == ([0.0] * 3, 3)
    assert time.perf_counter() - start < 0.8  # the timeout holds for the whole call


def test_non_numeric_batched_entries_count_individually():
    fn = batched(lambda responses, labels, infos: [1.0, "2", None, float("inf"), True])
    assert RewardScorer(fn).score([("", "", {})] * 5) == ([1.0, 0.0, 0.0, 0.0, 1.0], 3)


def test_weighted_sums_score_each_term_and_count_samples(user_module):
    fn = get_reward_fn("exact_match+0.1*format+-0.01*my_rewards.length")
    assert isinstance(fn, WeightedSum)
    scores, errors = RewardScorer(fn).score([("\\boxed{4}", "\\boxed{4}", {}), ("4", "5", {}), (None, "5", {})])
    assert scores == pytest.approx([1.0 + 0.1 - 0.01 * 9, -0.01, 0.0]) and errors == 1  # len("\\boxed{4}") == 9
    assert RewardScorer(get_reward_fn("2*exact_match")).score([("4", "4", {})]) == ([2.0], 0)


def test_math_plus_format():
    scorer = build_scorer(TaskCfg(name="t", reward="math+0.1*format"))
    scores, errors = scorer.score([("\\boxed{\\frac{1}{2}}", "0.5", {}), ("#### 3", "4", {}), ("0.5", "0.5", {})])
    assert scores == pytest.approx([1.1, 0.1, 1.0]) and errors == 0


@pytest.mark.parametrize(("response", "code"), [
    ("Here:\n```python\nx = 1\n```\nbetter:\n```python\nx = 2\n```\ndone", "x = 2\n"),
    ("```py\nx = 3\n```", "x = 3\n"),
    ("x = 4", "x = 4"),
])
def test_extract_code(response, code):
    assert extract_code(response) == code


def test_code_reward_runs_the_labels_tests_in_the_sandbox():
    task = TaskCfg(name="t", reward="code", sandbox=SandboxCfg(wall_time_s=2.0, cpu_time_s=1))
    scorer = build_scorer(task)
    label = "assert add(2, 3) == 5"
    good = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    loops = "def add(a, b):\n    while True: pass"
    start = time.perf_counter()
    assert scorer.score([(good, label, {}), (wrong, label, {}), (loops, label, {}), ("def add(", label, {})]) == (
        [1.0, 0.0, 0.0, 0.0], 0)  # a wrong or looping program is a wrong answer, not a reward error
    assert time.perf_counter() - start < 3.0
    assert scorer.timeout_s > task.sandbox.wall_time_s  # waits out the sandbox's own kill


def problems(**task):
    return reward_problems(SimpleNamespace(task=TaskCfg(name="t", **task)))


def test_reward_problems():
    assert problems(reward="math+0.1*format") == []
    assert problems(reward="remote", reward_url="http://localhost:1/score") == []
    assert problems(reward="remote") == ["task.reward=remote needs task.reward_url (the scoring server's address)"]
    assert problems(reward="math+0.5*remote") == problems(reward="remote")
    assert problems(reward="math+0.1*") == [
        "task.reward=math+0.1*: bad term '0.1*'; write name or weight*name, joined by + (e.g. math+0.1*format)"]
    assert problems(reward="code+0.1*format", sandbox=SandboxCfg(memory_mb=0, wall_time_s=-1)) == [
        "task.sandbox.wall_time_s must be > 0 (got -1)", "task.sandbox.memory_mb must be > 0 (got 0)"]
    assert problems(reward="nope", reward_timeout_s=0)[0] == "task.reward_timeout_s must be > 0 (got 0)"
