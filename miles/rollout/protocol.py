"""The rollout engine protocol: what the loops, the router (miles/rollout/router.py) and the weight-sync
transports (miles/transport/) call on an engine, whichever backend it is (`rollout.engine`):
native (miles/rollout/native.py), vLLM, SGLang.

An engine is a plain class, built in-process or as a Ray actor (miles/orchestrate/handles.py); the
callers go through a handle (`handle.call("generate", ...)`), by method name, so nothing type-checks a
call: this protocol states every method and argument a caller passes (the loops in miles/orchestrate/,
the fleet in miles/rollout/router.py, the transports), and `check_engine` names what a class lacks, a
method or an argument. The contract suite (tests/engine_contract.py) calls these methods as the
callers do, against every engine:

    generate(prompts, labels, n, temperature, max_new_tokens[, prompt_ids=, seeds=])  loop, multi-turn, router
    update_weights(weights, expected_checksum)        sync (miles/orchestrate/sync.py), transports, router
    update_draft_weights(weights, expected_checksum)  sync, with rollout.speculative.kind=draft_model
    release_memory(keep_weights=False)                colocation's train turn (miles/orchestrate/colocate.py)
    resume_memory(("weights",)), resume_memory(("kv_cache",))   colocation's sync
    health(), decode(ids), device                      supervision, multi-turn, colocation's memory peaks
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from miles.protocol_check import check_methods
from miles.types import Sample

TAGS = ("weights", "kv_cache")  # what release_memory / resume_memory act on


@runtime_checkable
class RolloutEngine(Protocol):
    device: torch.device

    def generate(self, prompts: list[str], labels: list[str], n: int = 1, temperature: float | None = None,
                 max_new_tokens: int | None = None, *, prompt_ids: list[list[int]] | None = None,
                 seeds: list[int] | None = None) -> list[Sample]:
        """n samples per prompt, grouped (samples[i*n:(i+1)*n] answer prompts[i], `group` = i), each
        with its response token ids, the engine's log-prob of every sampled token under
        softmax(logits / temperature), its finish reason, and (R3, MoE) its routed experts.
        `prompt_ids` replaces encoding `prompts` (multi-turn contexts); `seeds` (one per prompt):
        each group samples from its own seed, so a fleet samples as one engine. temperature 0: greedy."""

    def update_weights(self, weights, expected_checksum: str | None = None) -> str:
        """Load the trainer's weights (a state dict in the engine's dtype with the project's parameter
        names, the recipe's quantized payload, or in-process a FlatWeights); with a checksum, verify
        what the engine then holds (miles.transport.checksum.checksum) and raise WeightSyncError
        on a difference. Returns the held checksum ("" unchecked)."""

    def update_draft_weights(self, weights, expected_checksum: str | None = None) -> str:
        """Load the online-trained speculative draft model (rollout.speculative.kind=draft_model), as
        update_weights; an engine without such a draft raises (validation keeps it from being asked)."""

    def release_memory(self, tags: tuple[str, ...] = TAGS, *, keep_weights: bool = True) -> None:
        """Free the device memory of `tags` (colocation: the trainer's turn); generate raises until
        resume_memory. Releasing what is released is a no-op. keep_weights=False: the caller reloads the
        weights after resuming them (the colocated loop syncs every step), so the engine need keep no
        copy: until the next update_weights, generate raises. keep_weights=True: the weights come back
        by themselves where the engine can keep a copy (native: a host copy; vLLM: sleep level 1; SGLang:
        only with the server's enable_weights_cpu_backup), else update_weights is needed all the same."""

    def resume_memory(self, tags: tuple[str, ...] = TAGS) -> None:
        """Take the memory of `tags` back; weights released are reloaded by the next update_weights."""

    def health(self) -> dict:
        """What the engine is and holds: {"engine": name, "device": ..., "resident": [tags]}; raises
        when the engine cannot serve (a dead server)."""

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text, special tokens skipped (multi-turn tool parsing)."""


METHODS = ("generate", "update_weights", "update_draft_weights", "release_memory", "resume_memory", "health",
           "decode")


def check_engine(cls: type) -> None:
    """Raise TypeError naming the protocol methods `cls` lacks, then the protocol arguments its methods
    do not take as the callers pass them (miles/protocol_check.py)."""
    check_methods(cls, RolloutEngine, METHODS, "a rollout engine")
