"""Reward functions: built-ins, user functions by dotted path, weighted sums of them, safe scoring.

`task.reward` is a built-in name, a dotted path to a user function (`pkg.module.fn`, importable
from the working directory or the Python path), or a weighted sum of those (`math+0.1*format`).
Built-ins: exact_match, math (math-verify), format (an answer is present), code (the label's tests
run against the response's program in the sandbox of `task.sandbox`) and remote (a scoring server
at `task.reward_url`). A user function is called as

    fn(response: str, label: str, **info) -> float        # or `async def`; info: prompt=...
                                                           # (fn(response, label) works too)
    @batched                                               # or once per batch (plain or async):
    fn(responses: list[str], labels: list[str], infos: list[dict]) -> list[float]

A reward that raises, returns something that is not a number, or runs past
`task.reward_timeout_s` scores 0 and is counted (`rollout/reward_errors`); it never stops the run.
A reward that cannot be resolved is a config error before anything starts.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import re
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Callable

from miles.data.code_reward import code_reward
from miles.data.math_reward import format_reward, math_reward
from miles.data.plugins import import_dotted
from miles.data.remote_reward import post_samples

if TYPE_CHECKING:
    from miles.config.schema import TaskCfg

RewardFn = Callable[..., float]


def exact_match(response: str, label: str, **info) -> float:
    """1.0 when response and label agree up to surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == label.strip() else 0.0


def batched(fn):
    """Mark fn(responses, labels, infos) -> list[float] to be called once per batch, not per sample."""
    fn.miles_batched = True
    return fn


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "math": math_reward, "format": format_reward}


def _code(task: TaskCfg) -> RewardFn:
    fn = functools.partial(code_reward, limits=task.sandbox)
    # The sandbox kills a program at its wall time: wait that long plus start-up, so a program that
    # loops scores 0 as a wrong answer rather than as a reward error.
    fn.miles_timeout_s = max(task.reward_timeout_s, task.sandbox.wall_time_s + 5)
    return fn


def _remote(task: TaskCfg) -> RewardFn:
    if not task.reward_url:
        raise ValueError("task.reward=remote needs task.reward_url (the scoring server's address)")
    return batched(functools.partial(post_samples, task.reward_url, task.reward_timeout_s))


# Built-ins made from the task's settings (its sandbox limits, its server).
TASK_REWARDS: dict[str, Callable[[TaskCfg], RewardFn]] = {"code": _code, "remote": _remote}

_TERM = re.compile(r"\s*(?:(?P<weight>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*\*\s*)?"
                   r"(?P<name>[A-Za-z_][\w.]*)\s*")


class WeightedSum:
    """A spec such as `math+0.1*format`: each term scored on its own, the scores summed with weights."""

    def __init__(self, terms: list[tuple[float, RewardFn]]):
        self.terms = terms


def parse_spec(spec: str) -> list[tuple[float, str]]:
    """`math+0.1*format` -> [(1.0, "math"), (0.1, "format")]; a plain name is one term of weight 1."""
    terms = []
    for term in spec.split("+"):
        match = _TERM.fullmatch(term)
        if match is None:
            raise ValueError(f"task.reward={spec}: bad term {term.strip()!r}; "
                             "write name or weight*name, joined by + (e.g. math+0.1*format)")
        terms.append((float(match["weight"] or 1.0), match["name"]))
    return terms


def get_reward_fn(spec: str, task: TaskCfg | None = None) -> RewardFn | WeightedSum:
    """A built-in name, `module.path.function`, or a weighted sum of them (a `WeightedSum`).
    `task` supplies the settings some built-ins need (code: task.sandbox; remote: task.reward_url)."""
    terms = parse_spec(spec)
    if len(terms) == 1 and "*" not in spec:
        return _resolve(terms[0][1], task)
    return WeightedSum([(weight, _resolve(name, task)) for weight, name in terms])


def _resolve(spec: str, task: TaskCfg | None) -> RewardFn:
    if spec in REWARDS:
        return REWARDS[spec]
    if spec in TASK_REWARDS:
        if task is None:
            from miles.config.schema import TaskCfg

            task = TaskCfg()
        return TASK_REWARDS[spec](task)
    if "." not in spec:
        raise ValueError(f"unknown reward {spec!r}; valid names: {', '.join(sorted({**REWARDS, **TASK_REWARDS}))}, "
                         "a dotted path to your function (pkg.module.fn), or a weighted sum (math+0.1*format)")
    return import_dotted(spec, "task.reward")


def build_scorer(task: TaskCfg) -> RewardScorer:
    """The run's scorer: task.reward resolved with the task's sandbox limits, server and timeout."""
    return RewardScorer(get_reward_fn(task.reward, task), task.reward_timeout_s)


class RewardScorer:
    """Scores (response, label, info) triples with one reward (or a weighted sum), counting failures."""

    def __init__(self, fn: RewardFn | WeightedSum, timeout_s: float = 10.0):
        self.fn = fn
        self.timeout_s = getattr(fn, "miles_timeout_s", timeout_s)  # a reward that bounds its own time
        self._terms = [(w, RewardScorer(f, timeout_s)) for w, f in fn.terms] if isinstance(fn, WeightedSum) else None
        self.is_async = inspect.iscoroutinefunction(fn)
        self.is_batched = getattr(fn, "miles_batched", False)
        # The built-ins are fast and bound themselves: called inline (a pool hand-off per sample costs
        # more than exact_match itself); user functions get the thread pool and its timeout.
        self.inline = fn in REWARDS.values()
        self._info_keys = _accepted_keywords(fn)  # None: takes **info, everything goes
        # Threads mostly wait (on sandboxed programs, servers): the executor's default size.
        pooled = not (self.inline or self.is_async or self._terms)
        self._pool = ThreadPoolExecutor(thread_name_prefix="reward") if pooled else None

    def __call__(self, response: str, label: str, **info) -> float:
        """One score (the loop's `reward_fn` interface); failures score 0 and are counted by `score`."""
        return self.score([(response, label, info)])[0][0]

    def score(self, items: list[tuple[str, str, dict]]) -> tuple[list[float], int]:
        """(scores, failures): user sync rewards run in a thread pool with a per-call timeout, async
        ones concurrently in one event loop with the same timeout each, batched ones in one call
        with that timeout for the whole batch, the built-ins inline. A weighted sum scores term by
        term; a sample counts as one failure when any of its terms failed."""
        if not items:
            return [], 0
        terms = self._terms or [(1.0, self)]
        results = [(w, scorer._results(items)) for w, scorer in terms]
        scores = [sum(w * (r[i] or 0.0) for w, r in results) for i in range(len(items))]
        return scores, sum(any(r[i] is None for _, r in results) for i in range(len(items)))

    def _results(self, items) -> list[float | None]:
        """One reward's scores, None where the call failed."""
        if self.is_batched:
            results = self._batch(items)
        elif self.is_async:
            results = asyncio.run(self._score_async(items))
        elif self.inline:
            results = [_guarded(self.fn, r, label, self._info(info)) for r, label, info in items]
        else:
            futures = [self._pool.submit(self.fn, r, label, **self._info(info)) for r, label, info in items]
            results = [self._result(f) for f in futures]
        return [_as_score(r) for r in results]

    def _batch(self, items) -> list:
        responses, labels, infos = (list(column) for column in zip(*items))
        try:
            if self.is_async:
                out = asyncio.run(asyncio.wait_for(self.fn(responses, labels, infos), self.timeout_s))
            else:
                out = self._pool.submit(self.fn, responses, labels, infos).result(timeout=self.timeout_s)
        except Exception:  # raised or timed out: the whole batch failed
            out = None
        return list(out) if isinstance(out, (list, tuple)) and len(out) == len(items) else [None] * len(items)

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
