"""Decode-time state: one cache object per layer, owned by a ModelCache that tracks the length.

Each attention kind allocates its own layer cache through `new_cache(batch, max_len, dtype,
device)`: GQA keeps keys and values (`KVBuffer`), MLA keeps the compressed latent, linear
attention keeps a recurrent state. All rows of a batch share `length` (the rollout engine
left-pads prompts so that they end at the same column). `CausalLM.forward` lets every layer write
its new entries, then calls `advance` once after the last layer.

`SlotCache` is the GPU engine's static variant: a fixed number of slots (rows), each with its own
length (`lengths`, a device tensor the engine advances), so finished rows can be refilled with new
samples and the decode step keeps one shape for CUDA-graph capture. GQA layers (`KVBuffer`), MLA
layers (`MLACache`, miles/models/mla.py: the latent + rope key per column) and DSA layers
(`DSACache`, plus the indexer key) have slots; a slot-capable layer cache implements `update` with a
per-row start, `first_rows`, `copy_rows` and `tensors`.
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

    def update(self, start: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v: [B, Hkv, T, D] at [start, start + T); return all keys / values so far
        ([B, Hkv, start + T, D], views into the buffer). Slot decode: start [B] is each row's
        column (its T new columns follow it), and the whole buffer comes back (the slot mask hides
        unwritten columns)."""
        if isinstance(start, torch.Tensor):
            rows = torch.arange(k.shape[0], device=k.device)
            # An index put does not cast (a slice copy does): k / v may be in the autocast dtype.
            if k.shape[2] == 1:
                self.keys[rows, :, start] = k[:, :, 0].to(self.keys.dtype)
                self.values[rows, :, start] = v[:, :, 0].to(self.values.dtype)
            else:  # speculative verify: T columns per row from its own start
                cols = start[:, None] + torch.arange(k.shape[2], device=k.device)[None, :]
                self.keys[rows[:, None], :, cols] = k.transpose(1, 2).to(self.keys.dtype)
                self.values[rows[:, None], :, cols] = v.transpose(1, 2).to(self.values.dtype)
            return self.keys, self.values
        end = start + k.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"KV cache overflow: {end} positions needed, max_len is {self.keys.shape[2]}")
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]

    def select(self, index: torch.Tensor) -> None:
        self.keys, self.values = self.keys[index], self.values[index]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The buffers, rows first (what slot compaction moves and the memory report counts)."""
        return self.keys, self.values

    def first_rows(self, b: int) -> "KVBuffer":
        """A view of rows [0, b): same storage, so a graph captured on it sees later writes."""
        view = KVBuffer.__new__(KVBuffer)
        view.keys, view.values = self.keys[:b], self.values[:b]
        return view

    def copy_rows(self, dst: torch.Tensor, src: "KVBuffer", src_rows: torch.Tensor, width: int) -> None:
        """Rows dst of this buffer take columns [0, width) of src's rows src_rows (prefill -> slots)."""
        self.keys[dst, :, :width] = src.keys[src_rows, :, :width]
        self.values[dst, :, :width] = src.values[src_rows, :, :width]


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

    def track_steps(self, on: bool) -> None:
        """Speculative decoding: while on, layers whose state has no columns (linear attention) keep
        their state after each token of a forward, so `rewind` can go back to any of them."""
        for layer in self.layers:
            if hasattr(layer, "track_steps"):
                layer.track_steps = on

    def rewind(self, keep: torch.Tensor) -> None:
        """After a tracked forward of T tokens: row b keeps the state after its first keep[b] tokens
        (1..T). Attention layers need nothing: the caller masks the columns it drops."""
        for layer in self.layers:
            if hasattr(layer, "rewind"):
                layer.rewind(keep)


class SlotCache(ModelCache):
    """GQA / MLA decode state of `slots` rows of `max_len` columns; row r holds lengths[r] positions.

    `length` is the per-row tensor, so `CausalLM.forward` runs in slot-decode mode (one token per
    row, written at its own column); `advance` does nothing, since only the engine knows which rows
    are still live (it adds 1 to theirs).
    """

    def __init__(self, layers: list, max_len: int, slots: int, lengths: torch.Tensor | None = None):
        super().__init__(layers, max_len, slots)
        self.length = torch.zeros(slots, dtype=torch.long, device=self.device) if lengths is None else lengths

    @property
    def lengths(self) -> torch.Tensor:
        return self.length

    @property
    def device(self) -> torch.device:
        return self.layers[0].tensors()[0].device

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (a prefill cache is made in it, so its rows copy over unchanged)."""
        return self.layers[0].tensors()[0].dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def advance(self, n: int) -> None:
        pass

    def first_rows(self, b: int) -> "SlotCache":
        return SlotCache([layer.first_rows(b) for layer in self.layers], self.max_len, b, self.length[:b])

    def load_prefill(self, dst: torch.Tensor, prefill: ModelCache, src_rows: torch.Tensor, width: int) -> None:
        """Slots dst start from rows src_rows of a right-padded prefill cache (columns [0, width))."""
        for mine, theirs in zip(self.layers, prefill.layers):
            mine.copy_rows(dst, theirs, src_rows, width)

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Slots dst take over slots src (compaction into the rows a smaller graph covers)."""
        for layer in self.layers:
            for buffer in layer.tensors():
                buffer[dst] = buffer[src]
        self.length[dst] = self.length[src]
