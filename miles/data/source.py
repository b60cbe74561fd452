"""Prompt source of a run: the next training prompts of each step and the held-out eval set.

Built-in arithmetic draws fresh problems from a seeded generator; a prompt file is read in
seeded, reshuffled epochs. Either way the order depends only on `seed`.
"""

from __future__ import annotations

import numpy as np

from miles.config.schema import TaskCfg, TaskKind
from miles.data.arithmetic import ArithmeticTask, Example
from miles.data.prompts import load_prompt_file
from miles.data.tokenizer import DEFAULT_ALPHABET


class PromptSource:
    def __init__(self, cfg: TaskCfg, seed: int, stream: int = 0):
        """`stream` gives an independent training order for the same seed (the eval set stays the same)."""
        self.cfg = cfg
        self.rng = np.random.default_rng([seed, stream])
        if cfg.kind == TaskKind.arithmetic:
            self.task = ArithmeticTask(cfg.num_digits, cfg.ops, seed, cfg.eval_fraction, cfg.eval_size)
            self.train: list[Example] = []
            self.eval = self.task.eval_set()
        else:
            self.task = None
            self.train = load_prompt_file(cfg.train_file, cfg.prompt_key, cfg.label_key)
            self.eval = (
                load_prompt_file(cfg.eval_file, cfg.prompt_key, cfg.label_key)[: cfg.eval_size]
                if cfg.eval_file
                else []
            )
            self._order = self.rng.permutation(len(self.train))
            self._pos = 0

    def next_batch(self, n: int) -> list[Example]:
        if self.task is not None:
            return self.task.sample_train(n, self.rng)
        batch = []
        while len(batch) < n:
            if self._pos == len(self._order):  # epoch boundary: reshuffle
                self._order, self._pos = self.rng.permutation(len(self.train)), 0
            batch.append(self.train[self._order[self._pos]])
            self._pos += 1
        return batch

    def state(self) -> dict:
        """The data position, JSON-serializable: what a resumed run needs to draw the same next prompts."""
        state = {"rng": self.rng.bit_generator.state}
        if self.task is None:
            state.update(order=self._order.tolist(), pos=self._pos)
        return state

    def load_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        if self.task is None:
            self._order, self._pos = np.array(state["order"], dtype=np.int64), state["pos"]

    def alphabet(self) -> str:
        """Characters a char-level tokenizer built for this task must cover."""
        if self.task is not None:
            return DEFAULT_ALPHABET
        chars = {c for ex in self.train + self.eval for c in ex.prompt + ex.label}
        return "".join(sorted(chars))
