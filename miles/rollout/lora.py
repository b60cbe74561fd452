"""The native engine's side of LoRA (trainer.lora.rank > 0; docs/lora.md): the trainer's adapters,
applied unmerged over the engine's frozen base, replaced in place at every weight sync.

Unmerged: each adapted projection adds alpha / rank * B(A(x)) to its base output (the same
miles/models/lora.py module as the trainer's), so a sync is a copy of the adapters and nothing
else: the base weights, their flat buffer and any captured CUDA graph stay as they are. The checked
sync hashes the adapters the engine then holds (the base is the checkpoint both sides loaded).
Several adapters (trainer.lora.adapters) are all held and synced; each generate routes its prompts'
rows to theirs (NativeEngine.generate's `adapters`).
"""

from __future__ import annotations

import torch

from miles.config.schema import LoRACfg
from miles.models.lora import LoRA
from miles.transport.checksum import WeightSyncError, checksum


def engine_adapters(model: torch.nn.Module, cfg: LoRACfg, dtype: torch.dtype) -> LoRA:
    """Adapters of the trainer's shape in the engine's dtype, all zero until the first sync (the
    base model's outputs, as the trainer's fresh adapters give); no dropout at inference."""
    return LoRA(model, cfg.rank, cfg.alpha, 0.0, cfg.target_modules, dtype=dtype, zero=True,
                adapters=cfg.adapters).eval()


def load_synced(lora: LoRA, weights: dict[str, torch.Tensor], expected_checksum: str | None) -> str:
    """Copy the trainer's adapters in; with a checksum, verify the ones now held."""
    lora.load(weights)
    if expected_checksum is None:
        return ""
    held = checksum(lora.tensors())
    if held != expected_checksum:
        raise WeightSyncError(f"engine adapters checksum {held[:12]} != trainer's {expected_checksum[:12]}")
    return held
