"""Decode-time state: one cache object per layer, owned by a ModelCache that tracks the length.

Each attention kind allocates its own layer cache through `new_cache(batch, max_len, dtype,
device)`: GQA keeps keys and values (`KVBuffer`), MLA keeps the compressed latent, linear
attention keeps a recurrent state. All rows of a batch share `length` (the rollout engine
left-pads prompts so that they end at the same column). `CausalLM.forward` lets every layer write
its new entries, then calls `advance` once after the last layer.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LayerCache(Protocol):
    def select(self, index: torch.Tensor) -> None:
        """Keep / reorder batch rows in place: row i becomes old row index[i]."""


class KVBuffer:
    """Preallocated keys / values of one GQA layer: [B, Hkv, max_len, D] each."""

    def __init__(self, batch: int, heads: int, max_len: int, k_dim: int, v_dim: int, dtype, device):
        self.keys = torch.zeros(batch, heads, max_len, k_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, heads, max_len, v_dim, dtype=dtype, device=device)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v: [B, Hkv, T, D] at [start, start + T); return all keys / values so far
        ([B, Hkv, start + T, D], views into the buffer)."""
        end = start + k.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"KV cache overflow: {end} positions needed, max_len is {self.keys.shape[2]}")
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]

    def select(self, index: torch.Tensor) -> None:
        self.keys, self.values = self.keys[index], self.values[index]


class ModelCache:
    """The per-layer caches of one batch plus the number of positions already written."""

    def __init__(self, layers: list, max_len: int, batch_size: int):
        self.layers = layers
        self.max_len = max_len
        self.batch_size = batch_size
        self.length = 0

    def advance(self, n: int) -> None:
        self.length += n

    def select(self, index: torch.Tensor) -> "ModelCache":
        """Keep / reorder batch rows in place: row i becomes old row index[i]. index: LongTensor [B'].
        The caller must select the same rows of its attention mask."""
        for layer in self.layers:
            layer.select(index)
        self.batch_size = len(index)
        return self
