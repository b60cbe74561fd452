"""Trainer backends. `torch_trainer.TorchTrainer` is the native one.

Any trainer (a future Megatron-core backend included) offers the `Trainer` protocol; the loop only
calls these methods, through a handle (miles/orchestrate/handles.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from miles.types import TrainBatch


class Trainer(Protocol):
    def train_rl(self, batch: TrainBatch) -> dict[str, float]: ...

    def train_sft(self, batch: TrainBatch) -> dict[str, float]: ...

    def get_weights(self) -> tuple[dict[str, torch.Tensor], str]: ...

    def save(self, path: str) -> None: ...
