import numpy as np
import pytest

from miles.data.arithmetic import ArithmeticTask
from miles.data.example import Example


def _parse(prompt: str) -> tuple[int, str, int]:
    assert prompt.endswith("=")
    body = prompt[:-1]
    for i, ch in enumerate(body):
        if i > 0 and ch in "+-*":
            return int(body[:i]), ch, int(body[i + 1 :])
    raise AssertionError(f"no operator in {prompt!r}")


def test_deterministic_for_a_seed():
    task = ArithmeticTask(ops="+-*", seed=3)
    a = task.sample_train(200, np.random.default_rng(7))
    b = task.sample_train(200, np.random.default_rng(7))
    c = task.sample_train(200, np.random.default_rng(8))
    assert a == b
    assert a != c
    assert task.eval_set() == ArithmeticTask(ops="+-*", seed=3).eval_set()
    assert task.eval_set() != ArithmeticTask(ops="+-*", seed=4).eval_set()


def test_train_never_contains_eval_problems():
    task = ArithmeticTask(ops="+-*", eval_fraction=0.1, eval_size=256)
    eval_prompts = {ex.prompt for ex in task.eval_set()}
    train = task.sample_train(5000, np.random.default_rng(0))
    assert len(train) == 5000
    assert not eval_prompts & {ex.prompt for ex in train}
    assert not any(task.is_eval(*_parse(ex.prompt)) for ex in train)


def test_labels_are_exact_results():
    task = ArithmeticTask(num_digits=3, ops="+-*")
    examples = task.sample_train(500, np.random.default_rng(1))
    seen_ops = set()
    for ex in examples:
        a, op, b = _parse(ex.prompt)
        assert 0 <= a < 1000 and 0 <= b < 1000
        seen_ops.add(op)
        assert int(ex.label) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert ex.label == str(int(ex.label))
    assert seen_ops == {"+", "-", "*"}
    assert task.make_example(3, "-", 15) == Example("3-15=", "-12")
    assert task.make_example(12, "*", 34) == Example("12*34=", "408")
    assert task.make_example(99, "+", 1) == Example("99+1=", "100")


def test_eval_set_has_eval_size_distinct_eval_problems():
    for task in (ArithmeticTask(ops="+-", eval_size=100), ArithmeticTask(num_digits=4, eval_size=300)):
        evals = task.eval_set()
        assert len(evals) == task.eval_size
        assert len({ex.prompt for ex in evals}) == task.eval_size
        assert all(task.is_eval(*_parse(ex.prompt)) for ex in evals)


def test_small_space_returns_every_eval_problem():
    task = ArithmeticTask(num_digits=1, ops="+", eval_fraction=0.2, eval_size=256)
    expected = {f"{a}+{b}=" for a in range(10) for b in range(10) if task.is_eval(a, "+", b)}
    assert 0 < len(expected) < 256
    assert {ex.prompt for ex in task.eval_set()} == expected


def test_eval_fraction_of_problem_space():
    task = ArithmeticTask(num_digits=2, ops="+-*", eval_fraction=0.1)
    n_eval = sum(task.is_eval(a, op, b) for op in "+-*" for a in range(100) for b in range(100))
    assert task.problem_space_size == 30_000
    assert abs(n_eval / 30_000 - 0.1) < 0.01


def test_sft_text():
    assert ArithmeticTask.sft_text(Example("12+34=", "46")) == ("12+34=", "46")


@pytest.mark.parametrize(
    "kwargs",
    [{"num_digits": 0}, {"ops": "/"}, {"ops": ""}, {"eval_fraction": 0.0}, {"eval_fraction": 1.0}, {"eval_size": 0}],
)
def test_invalid_config(kwargs):
    with pytest.raises(ValueError):
        ArithmeticTask(**kwargs)
