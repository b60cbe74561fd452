"""The native engine's side of LoRA (trainer.lora.rank > 0; docs/lora.md): the trainer's adapters,
applied unmerged over the engine's frozen base, replaced in place at every weight sync.

Unmerged: each adapted projection adds alpha / rank * B(A(x)) to its base output (the same
miles/models/lora.py module as the trainer's), so a sync is a copy of the adapters and nothing
else: the base weights, their flat buffer and any captured CUDA graph stay as they are. The checked
sync hashes the adapters the engine then holds (the base is the checkpoint both sides loaded).
Several adapters (trainer.lora.adapters) are all held and synced; each generate routes its prompts'
rows to theirs (NativeEngine.generate's `adapters`).

Merged (trainer.lora.merge_in_engine=true, one adapter): each sync writes base + alpha / rank * B @ A
into the adapted projections' weights in place, from a host copy of the base taken at build, and
decode runs the base model's kernels alone (no adapter GEMMs). The price: one rounding of the sum to
the engine's dtype, which the trainer's unmerged forward does not have (mismatch), a host copy of
the adapted weights, and a host-to-device copy of them per sync (benchmarks/lora_speed.py). Not
over a base the engine holds quantized (precision=fp8, int4_qat, bf16_train_*_rollout): FP8 / INT4
weights cannot hold W + B A exactly, so LoRA.keep_base refuses (validate() first).

Over a quantized base the adapters hook the engine's QuantLinear layers, unmerged, in the engine's
dtype; under QLoRA the trainer's frozen base holds the same codes (miles/precision/qlora.py).
"""

from __future__ import annotations

import torch

from miles.config.schema import LoRACfg
from miles.models.lora import LoRA
from miles.transport.checksum import WeightSyncError, checksum


def engine_adapters(model: torch.nn.Module, cfg: LoRACfg, dtype: torch.dtype) -> LoRA:
    """Adapters of the trainer's shape in the engine's dtype, all zero until the first sync (the
    base model's outputs, as the trainer's fresh adapters give); no dropout at inference. Merged
    (trainer.lora.merge_in_engine): the base weights are copied now, while they are the
    checkpoint's, and the adapters' forward hooks are off from the start (CUDA graphs captured later
    never contain them)."""
    lora = LoRA(model, cfg.rank, cfg.alpha, 0.0, cfg.target_modules, dtype=dtype, zero=True,
                adapters=cfg.adapters).eval()
    if cfg.merge_in_engine:
        lora.keep_base()
    return lora


def load_synced(lora: LoRA, weights: dict[str, torch.Tensor], expected_checksum: str | None) -> str:
    """Copy the trainer's adapters in (merged: and into the base weights); with a checksum, verify
    the adapters now held."""
    lora.load(weights)
    if lora.merges_into_base:
        lora.merge_into_base()
    if expected_checksum is None:
        return ""
    held = checksum(lora.tensors())
    if held != expected_checksum:
        raise WeightSyncError(f"engine adapters checksum {held[:12]} != trainer's {expected_checksum[:12]}")
    return held
