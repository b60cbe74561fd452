import pytest

from miles.data.rewards import REWARDS, exact_match, get_reward_fn, parse_spec


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("42", "42", 1.0),
        (" 42\n", "42", 1.0),
        ("42", " 42 ", 1.0),
        ("-12", "-12", 1.0),
        ("42", "43", 0.0),
        ("042", "42", 0.0),
        ("4 2", "42", 0.0),
        ("", "42", 0.0),
        ("", "", 1.0),
    ],
)
def test_exact_match(response, label, expected):
    assert exact_match(response, label) == expected


def test_registry():
    assert REWARDS["exact_match"] is exact_match
    assert get_reward_fn("exact_match") is exact_match


def test_unknown_reward_lists_valid_names():
    with pytest.raises(ValueError, match="exact_match") as err:
        get_reward_fn("f1")
    assert "'f1'" in str(err.value)


def test_builtins_are_registered():
    assert {"exact_match", "math", "format"} <= set(REWARDS)
    assert callable(get_reward_fn("code"))  # made from the task's sandbox limits (defaults without a task)
    with pytest.raises(ValueError, match="code, exact_match, format, math, remote"):
        get_reward_fn("cod")


@pytest.mark.parametrize(("spec", "terms"), [
    ("math", [(1.0, "math")]),
    ("math+0.1*format", [(1.0, "math"), (0.1, "format")]),
    (" math + 0.1 * format ", [(1.0, "math"), (0.1, "format")]),
    ("2*my.mod.fn+-0.5*format+.5*exact_match", [(2.0, "my.mod.fn"), (-0.5, "format"), (0.5, "exact_match")]),
    ("1e-2*format", [(0.01, "format")]),
])
def test_parse_spec(spec, terms):
    assert parse_spec(spec) == terms


@pytest.mark.parametrize(("spec", "bad"), [
    ("math+", "''"), ("math+0.1*", "'0.1*'"), ("0.1 format", "'0.1 format'"), ("math+2*3*format", "'2*3*format'"),
    ("math+x*format", "'x*format'"),
])
def test_bad_weighted_sums_name_the_bad_term(spec, bad):
    with pytest.raises(ValueError, match="bad term") as err:
        get_reward_fn(spec)
    assert bad in str(err.value) and f"task.reward={spec}" in str(err.value)


def test_a_weighted_sum_names_its_unknown_term():
    with pytest.raises(ValueError, match="unknown reward 'f1'"):
        get_reward_fn("math+0.5*f1")
