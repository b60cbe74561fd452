"""Rollout engines. `native.NativeEngine` runs the same miles.models modules as the trainer.

Any engine (a future SGLang adapter included) offers the `RolloutEngine` protocol; the loop only
calls these methods, through a handle (miles/orchestrate/handles.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from miles.types import Sample


class RolloutEngine(Protocol):
    def generate(
        self, prompts: list[str], labels: list[str], n: int = 1,
        temperature: float | None = None, max_new_tokens: int | None = None,
    ) -> list[Sample]: ...

    def update_weights(self, weights: dict[str, torch.Tensor], expected_checksum: str | None = None) -> str: ...
