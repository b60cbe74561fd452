"""Reward functions: a registry of built-ins, user functions by dotted path, and safe scoring.

`task.reward` is a registered name (`exact_match`) or a dotted path to a user function
(`pkg.module.fn`, importable from the working directory or the Python path), called as

    fn(response: str, label: str, **info) -> float        # or `async def`; info: prompt=...
                                                           # (fn(response, label) works too)

A reward that raises, returns something that is not a number, or runs past
`task.reward_timeout_s` scores 0 and is counted (`rollout/reward_errors`); it never stops the run.
A reward that cannot be resolved is a config error before anything starts.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

RewardFn = Callable[..., float]


def exact_match(response: str, label: str, **info) -> float:
    """1.0 when response and label agree up to surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == label.strip() else 0.0


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match}


def get_reward_fn(spec: str) -> RewardFn:
    """A registered name, or `module.path.function`."""
    if spec in REWARDS:
        return REWARDS[spec]
    if os.getcwd() not in sys.path:  # a user's reward module beside the data, run from its folder
        sys.path.append(os.getcwd())
    module, _, name = spec.rpartition(".")
    if not module:
        raise ValueError(f"unknown reward {spec!r}; valid names: {', '.join(sorted(REWARDS))}, "
                         "or a dotted path to your function (pkg.module.fn)")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"task.reward={spec}: cannot import it ({error})") from None
    if not callable(fn):
        raise ValueError(f"task.reward={spec}: {type(fn).__name__} is not a function")
    return fn


class RewardScorer:
    """Scores (response, label, info) triples with one reward function, counting failures."""

    def __init__(self, fn: RewardFn, timeout_s: float = 10.0):
        self.fn, self.timeout_s = fn, timeout_s
        self.is_async = inspect.iscoroutinefunction(fn)
        # The built-ins are fast and cannot hang: called inline (a pool hand-off per sample costs
        # more than exact_match itself); user functions get the thread pool and its timeout.
        self.inline = fn in REWARDS.values()
        self._info_keys = _accepted_keywords(fn)  # None: takes **info, everything goes
        self._pool = None if self.inline or self.is_async else ThreadPoolExecutor(4, thread_name_prefix="reward")

    def __call__(self, response: str, label: str, **info) -> float:
        """One score (the loop's `reward_fn` interface); failures score 0 and are counted by `score`."""
        return self.score([(response, label, info)])[0][0]

    def score(self, items: list[tuple[str, str, dict]]) -> tuple[list[float], int]:
        """(scores, failures): user sync rewards run in a thread pool with a per-call timeout, async
        ones concurrently in one event loop with the same timeout each, the built-ins inline."""
        if self.is_async:
            results = asyncio.run(self._score_async(items))
        elif self.inline:
            results = [_guarded(self.fn, r, label, self._info(info)) for r, label, info in items]
        else:
            futures = [self._pool.submit(self.fn, r, label, **self._info(info)) for r, label, info in items]
            results = [self._result(f) for f in futures]
        scores = [_as_score(r) for r in results]
        return [0.0 if s is None else s for s in scores], sum(s is None for s in scores)

    def _info(self, info: dict) -> dict:
        return info if self._info_keys is None else {k: v for k, v in info.items() if k in self._info_keys}

    def _result(self, future):
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            return None  # the call may still be running; its result is ignored
        except Exception:
            return None

    async def _score_async(self, items):
        async def one(response, label, info):
            try:
                return await asyncio.wait_for(self.fn(response, label, **self._info(info)), self.timeout_s)
            except Exception:
                return None

        return await asyncio.gather(*(one(*item) for item in items))


def _guarded(fn, response: str, label: str, info: dict):
    try:
        return fn(response, label, **info)
    except Exception:
        return None


def _accepted_keywords(fn) -> set[str] | None:
    """Keyword arguments fn takes besides (response, label): None when it has **kwargs, so a plain
    fn(response, label) keeps working and gets no info."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _as_score(value) -> float | None:
    """A finite number (bools count as 0 / 1), else None: the call failed."""
    if not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None
