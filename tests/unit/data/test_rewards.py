import pytest

from miles.data.rewards import REWARDS, exact_match, get_reward_fn


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
