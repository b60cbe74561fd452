"""Name -> function registries for advantage estimators, policy losses and KL estimators.

ADVANTAGES holds sequence-level estimators, called as fn(rewards [N], group_ids [N], norm_by_std=...)
-> advantages [N]. TOKEN_ADVANTAGES holds estimators that need a critic, called as
fn(token_rewards [B, T], values [B, T], mask [B, T], gamma, lam) -> (advantages, returns) [B, T]; they
are a separate registry so that `algo.advantage` can never name one that the loop would call with the
sequence-level signature.

Modules register with the decorators below; `get(registry, kind, name)` raises a ValueError that
lists the valid names, so a typo in `algo.*` reads as a config mistake, not a KeyError.
"""

from __future__ import annotations

from typing import Callable

ADVANTAGES: dict[str, Callable] = {}
TOKEN_ADVANTAGES: dict[str, Callable] = {}
POLICY_LOSSES: dict[str, Callable] = {}
KL_ESTIMATORS: dict[str, Callable] = {}


def _register(registry: dict[str, Callable], name: str):
    def wrap(fn: Callable) -> Callable:
        registry[name] = fn
        return fn

    return wrap


def register_advantage(name: str):
    return _register(ADVANTAGES, name)


def register_token_advantage(name: str):
    return _register(TOKEN_ADVANTAGES, name)


def register_policy_loss(name: str):
    return _register(POLICY_LOSSES, name)


def register_kl(name: str):
    return _register(KL_ESTIMATORS, name)


def get(registry: dict[str, Callable], kind: str, name: str) -> Callable:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(registry))}")
    return registry[name]

