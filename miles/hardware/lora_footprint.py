"""Parameters of the LoRA adapters a run trains (trainer.lora), for the memory planner: counted on
a meta-device model, so full-size configs cost no memory."""

from __future__ import annotations

import torch

from miles.models.config import ArchConfig

# Memoized (ArchConfig is not hashable: keyed by its repr): the planner asks for every layout it tries.
_CACHE: dict[tuple, int] = {}


def lora_params(arch: ArchConfig, rank: int, target_modules, adapters: int = 1) -> int:
    """rank x (in + out) summed over the decoder projections `target_modules` selects, for each of
    `adapters` adapters (trainer.lora.adapters; 0 or 1: the run's one adapter)."""
    if rank <= 0:
        return 0
    return max(1, adapters) * _one_adapter(arch, rank, target_modules)


def _one_adapter(arch: ArchConfig, rank: int, target_modules) -> int:
    key = (repr(arch), rank, tuple(target_modules))
    if key not in _CACHE:
        from miles.models import CausalLM
        from miles.models.lora import find_targets

        with torch.device("meta"):
            model = CausalLM(arch)
        _CACHE[key] = sum(rank * (m.in_features + m.out_features) for _, m in find_targets(model, key[2]))
    return _CACHE[key]
