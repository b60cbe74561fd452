"""Reward functions mapping (response, label) to a scalar, and a registry to pick them by name."""

from __future__ import annotations

from typing import Callable

RewardFn = Callable[[str, str], float]


def exact_match(response: str, label: str) -> float:
    """1.0 when response and label agree up to surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == label.strip() else 0.0


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match}


def get_reward_fn(name: str) -> RewardFn:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward {name!r}; valid names: {', '.join(sorted(REWARDS))}"
        ) from None
