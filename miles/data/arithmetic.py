"""Built-in synthetic task: integer arithmetic problems "a<op>b=" with exact-answer labels.

Operands range over 0 .. 10**num_digits - 1 and ops over any of "+", "-", "*". The held-out
eval split is a pure function of the problem: "a op b" is eval iff its blake2b hash, read as
a number in [0, 1), falls under eval_fraction. The split is therefore the same for every
seed, digit count and process (Python's hash() is salted per process, so it is not used),
and training draws simply reject eval problems.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from miles.data.example import Example

SUPPORTED_OPS = "+-*"

# Below this many problems eval_set enumerates the whole space, which also covers spaces with
# fewer than eval_size eval problems; above it, rejection sampling is fast and cannot stall.
_ENUMERATE_LIMIT = 100_000


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


@dataclass
class ArithmeticTask:
    """Problems "a<op>b=" answered by the exact decimal result (negative for "-" when a < b)."""

    num_digits: int = 2
    ops: str = "+"
    seed: int = 0
    eval_fraction: float = 0.1
    eval_size: int = 256

    def __post_init__(self) -> None:
        if self.num_digits < 1:
            raise ValueError(f"num_digits must be >= 1, got {self.num_digits}")
        if not self.ops or any(op not in SUPPORTED_OPS for op in self.ops):
            raise ValueError(f"ops must be a non-empty string of {SUPPORTED_OPS!r}, got {self.ops!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")
        # "++" would double-weight "+" in sampling and duplicate problems in enumeration.
        self.ops = "".join(dict.fromkeys(self.ops))

    @property
    def operand_limit(self) -> int:
        """Operands are drawn from range(operand_limit)."""
        return 10**self.num_digits

    @property
    def problem_space_size(self) -> int:
        return len(self.ops) * self.operand_limit**2

    def is_eval(self, a: int, op: str, b: int) -> bool:
        """Whether problem "a op b" belongs to the held-out eval split."""
        digest = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < self.eval_fraction

    def make_example(self, a: int, op: str, b: int) -> Example:
        return Example(prompt=f"{a}{op}{b}=", label=str(_apply(a, op, b)))

    def _draw(self, rng: np.random.Generator) -> tuple[int, str, int]:
        op = self.ops[int(rng.integers(len(self.ops)))]
        a, b = (int(x) for x in rng.integers(self.operand_limit, size=2))
        return a, op, b

    def sample_train(self, n: int, rng: np.random.Generator) -> list[Example]:
        """n training problems drawn uniformly (with replacement) from the non-eval problems."""
        out: list[Example] = []
        while len(out) < n:
            a, op, b = self._draw(rng)
            if not self.is_eval(a, op, b):
                out.append(self.make_example(a, op, b))
        return out

    def eval_set(self) -> list[Example]:
        """A fixed list of eval_size distinct eval problems, chosen by `seed`.

        When the whole space holds fewer eval problems than eval_size, all of them are returned.
        """
        # A separate stream keyed by seed, so the eval set never depends on training draws.
        rng = np.random.default_rng([self.seed, 0xE7A1])
        if self.problem_space_size <= _ENUMERATE_LIMIT:
            problems = [
                (a, op, b)
                for op in self.ops
                for a in range(self.operand_limit)
                for b in range(self.operand_limit)
                if self.is_eval(a, op, b)
            ]
            order = rng.permutation(len(problems))[: self.eval_size]
            return [self.make_example(*problems[i]) for i in order]

        expected = self.problem_space_size * self.eval_fraction
        if self.eval_size > expected / 2:
            raise ValueError(
                f"eval_size={self.eval_size} is too large for ~{expected:.0f} eval problems "
                f"(num_digits={self.num_digits}, ops={self.ops!r}, eval_fraction={self.eval_fraction})"
            )
        seen: set[tuple[int, str, int]] = set()
        chosen: list[Example] = []
        while len(chosen) < self.eval_size:
            problem = self._draw(rng)
            if problem not in seen and self.is_eval(*problem):
                seen.add(problem)
                chosen.append(self.make_example(*problem))
        return chosen

    @staticmethod
    def sft_text(example: Example) -> tuple[str, str]:
        """(prompt, response) for supervised fine-tuning; the engine appends eos."""
        return example.prompt, example.label
