"""Prompt source of a run: the next training prompts of each step and the held-out eval set.

Built-in arithmetic draws fresh problems from a seeded generator; a prompt file (text, or records
with images: kind=images), or the generated splits of the visual task (kind=shape_count), is read
in epochs, each in a fresh seeded order (`task.shuffle`) or in file order. Either way the order
depends only on `seed`.
"""

from __future__ import annotations

import numpy as np

from miles.config.schema import TaskCfg, TaskKind
from miles.data.arithmetic import ArithmeticTask
from miles.data import shape_count
from miles.data.example import Example
from miles.data.images import load_image_file, to_example
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
            if cfg.kind == TaskKind.shape_count:
                self.train = shape_count.examples(seed, "train", cfg.train_size)
                self.eval = shape_count.examples(seed, "eval", cfg.eval_size, train_size=cfg.train_size)
            else:
                self.train = self._load(cfg.train_file)
                self.eval = self._load(cfg.eval_file)[: cfg.eval_size] if cfg.eval_file else []
            self._order, self._pos = self._epoch_order(), 0

    def _load(self, path: str) -> list[Example]:
        cfg = self.cfg
        if cfg.kind == TaskKind.images:
            return [to_example(ex) for ex in load_image_file(path, cfg.prompt_key, cfg.label_key)]
        return load_prompt_file(path, cfg.prompt_key, cfg.label_key, label_extractor=cfg.label_extractor)

    def _epoch_order(self) -> np.ndarray:
        # File order draws nothing from rng, so it still resumes exactly from (order, pos).
        if self.cfg.shuffle:
            return self.rng.permutation(len(self.train))
        return np.arange(len(self.train))

    def next_batch(self, n: int) -> list[Example]:
        if self.task is not None:
            return self.task.sample_train(n, self.rng)
        batch = []
        while len(batch) < n:
            if self._pos == len(self._order):  # epoch boundary
                self._order, self._pos = self._epoch_order(), 0
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
        chars: set[str] = set()
        for ex in self.train + self.eval:
            chars.update(ex.prompt, ex.label)
            # Every turn reaches the model, not only the last user one kept in `prompt`.
            for message in ex.messages or ():
                content = message["content"]  # text, or (image prompts) a list of parts
                chars.update(content if isinstance(content, str) else "".join(p.get("text", "") for p in content))
        return "".join(sorted(chars))
