"""`Choice`: the base of every named choice of the config (`rollout=vllm`, `rollout.weight_sync=broadcast`).

A module of its own on the ground floor, so that the code a choice selects can define its names
where it lives: `TransportName` in miles/transport/protocol.py (the transport registry's keys) is
the Enum of `rollout.weight_sync`; the config's own choices are in miles/config/schema.py.
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A named choice of the config: compares equal to its value ("vllm" == EngineName.vllm) and
    prints as it (f"rollout={EngineName.vllm}" -> "rollout=vllm") on every Python version."""

    def __str__(self) -> str:
        return self.value
