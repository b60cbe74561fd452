import pytest

from miles.data.answers import EXTRACTORS, extract_boxed, extract_gsm8k


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
        ("#### 1,234,567", "1234567"),
        ("total: 12,000 + 500\n#### 12,500", "12500"),
        ("#### -3.5", "-3.5"),
        ("####42", "42"),
        ("#### 7\nsome trailing note", "7"),
        ("first #### 1\nthen #### 2", "2"),  # the last marker wins
        ("#### 2,3", "2,3"),  # not a thousands separator: kept
    ],
)
def test_gsm8k(text, answer):
    assert extract_gsm8k(text) == answer


@pytest.mark.parametrize("text", ["The answer is 72.", "#### ", "####\n\n", ""])
def test_gsm8k_no_answer(text):
    assert extract_gsm8k(text) is None


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{a^{b^{c}} + \\sqrt{2}}", "a^{b^{c}} + \\sqrt{2}"),
        ("\\fbox{5}", "5"),
        ("\\boxed {7}", "7"),
        ("\\boxed{ 8 }", "8"),
        ("try \\boxed{1}, no: \\boxed{2}, final \\fbox{3}", "3"),
        ("\\boxed{1} and an unclosed \\boxed{2", "1"),  # the last balanced box
    ],
)
def test_boxed(text, answer):
    assert extract_boxed(text) == answer


@pytest.mark.parametrize("text", ["no box here: 42", "\\boxed{unclosed", "\\boxed", ""])
def test_boxed_no_answer(text):
    assert extract_boxed(text) is None


def test_extractor_names():
    assert set(EXTRACTORS) == {"plain", "gsm8k", "boxed"}
    assert EXTRACTORS["plain"]("  x \n") == "x"
    assert EXTRACTORS["plain"](" \n") is None
    assert EXTRACTORS["gsm8k"] is extract_gsm8k and EXTRACTORS["boxed"] is extract_boxed
