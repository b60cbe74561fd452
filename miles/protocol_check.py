"""Checking a class against a Protocol of methods, by name and by arguments, for both sides' protocols
(miles/rollout/protocol.py `check_engine`, miles/trainer/protocol.py `check_trainer`).

Components are called through handles by method name (in-process or as Ray actors), so nothing
type-checks a call; `check_methods` names what a class lacks: a method, or an argument the callers
pass that its method does not take.
"""

from __future__ import annotations

import inspect


def check_methods(cls: type, protocol: type, methods: tuple[str, ...], what: str) -> None:
    """Raise TypeError naming the `methods` of `protocol` that `cls` lacks, then the protocol arguments
    its methods do not take as the callers pass them: a positional one at its place and by name, a
    keyword-only one by name; *args / **kwargs take anything."""
    missing = [m for m in methods if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(f"{cls.__name__} is not {what}: it lacks {', '.join(missing)}")
    problems = [f"{m}({p})" for m in methods for p in unaccepted(getattr(protocol, m), getattr(cls, m))]
    if problems:
        raise TypeError(f"{cls.__name__} is not {what}: its methods do not take the protocol's "
                        f"arguments {', '.join(problems)}")


def unaccepted(spec, impl) -> list[str]:
    """The parameters of `spec` that `impl` does not take as a caller following `spec` passes them."""
    want = [p for p in inspect.signature(spec).parameters.values() if p.name != "self"]
    have = [p for p in inspect.signature(impl).parameters.values() if p.name != "self"]
    kinds = {p.kind for p in have}
    positional = [p.name for p in have if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name for p in have if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    out = []
    for i, p in enumerate(want):
        at_place = inspect.Parameter.VAR_POSITIONAL in kinds or (i < len(positional) and positional[i] == p.name)
        named = inspect.Parameter.VAR_KEYWORD in kinds or p.name in by_name
        if not (named and (at_place or p.kind == p.KEYWORD_ONLY)):
            out.append(p.name)
    return out
