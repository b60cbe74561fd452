"""The rollout engine protocol: what the loops, the router (miles/rollout/router.py) and the weight-sync
transports (miles/transport/) call on an engine, whichever backend it is (`rollout.engine`):
native (miles/rollout/native.py), vLLM, SGLang.

An engine is a plain class, built in-process or as a Ray actor (miles/orchestrate/handles.py); the
callers go through a handle (`handle.call("generate", ...)`), so this protocol states the methods
and their contracts, and `check_engine` names what a class lacks.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from miles.types import Sample

TAGS = ("weights", "kv_cache")  # what release_memory / resume_memory act on


@runtime_checkable
class RolloutEngine(Protocol):
    device: torch.device

    def generate(self, prompts: list[str], labels: list[str], n: int = 1, temperature: float | None = None,
                 max_new_tokens: int | None = None, prompt_ids: list[list[int]] | None = None,
                 seeds: list[int] | None = None) -> list[Sample]:
        """n samples per prompt, grouped (samples[i*n:(i+1)*n] answer prompts[i], `group` = i), each
        with its response token ids, the engine's log-prob of every sampled token under
        softmax(logits / temperature), its finish reason, and (R3, MoE) its routed experts.
        `prompt_ids` replaces encoding `prompts` (multi-turn contexts); `seeds` (one per prompt):
        each group samples from its own seed, so a fleet samples as one engine. temperature 0: greedy."""

    def update_weights(self, weights, expected_checksum: str | None = None) -> str:
        """Load the trainer's weights (a state dict in the engine's dtype with the project's parameter
        names, the recipe's quantized payload, or in-process a FlatWeights); with a checksum, verify
        what the engine then holds (miles.orchestrate.weight_sync.checksum) and raise WeightSyncError
        on a difference. Returns the held checksum ("" unchecked)."""

    def release_memory(self, tags: tuple[str, ...] = TAGS) -> None:
        """Free the device memory of `tags` (colocation: the trainer's turn); generate raises until
        resume_memory. Releasing what is released is a no-op."""

    def resume_memory(self, tags: tuple[str, ...] = TAGS) -> None:
        """Take the memory of `tags` back; weights released are reloaded by the next update_weights."""

    def health(self) -> dict:
        """What the engine is and holds: {"engine": name, "device": ..., "resident": [tags]}; raises
        when the engine cannot serve (a dead server)."""

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text, special tokens skipped (multi-turn tool parsing)."""


METHODS = ("generate", "update_weights", "release_memory", "resume_memory", "health", "decode")


def check_engine(cls: type) -> None:
    """Raise TypeError naming the protocol methods `cls` lacks."""
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(f"{cls.__name__} is not a rollout engine: it lacks {', '.join(missing)}")
