"""Weights as one flat buffer: what in-process weight sync copies, and what the engine's parameters live in.

Both sides hold a `FlatWeights` of the same layout (names, shapes, offsets, one dtype): the trainer
fills its copy from the fp32 master weights (one dtype-converting copy per tensor, batched in one
foreach call), the engine's parameters are views into its own copy, so a sync is a single
device-to-device copy of the buffer, and the check is `checksum()` of each side's buffer: a few
reduction kernels over the bytes, computed where they live (no host round trip, no SHA-256 on the
host). Used where trainer and engine share a process (ray.enabled=false) and the engine holds
plain weights (recipes without a quantized rollout format).

    engine_flat = FlatWeights.adopt(engine_model)                    # params become views
    sync = FlatWeights.like(engine_flat.layout, device)              # the trainer's copy
    sync.fill_from(trainer_model.state_dict()); digest = sync.checksum()
    engine_flat.copy_from(sync); assert engine_flat.checksum() == digest
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

ROW = 4096  # the buffer is a [rows, ROW] matrix of 32-bit words for the checksum
BLOCK_BYTES = 64 << 20  # the checksum reduces 64 MiB of words at a time (128 MiB of int64 temporaries)


@dataclass(frozen=True)
class FlatLayout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # element offsets into the buffer
    numel: int  # buffer elements, padded so that its bytes form whole ROW-word rows
    dtype: torch.dtype

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> "FlatLayout":
        names = tuple(sorted(tensors, key=_grouped))
        shapes = tuple(tuple(tensors[n].shape) for n in names)
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += max(1, _prod(shape))
        per_row = ROW * 4 // dtype.itemsize
        return cls(names, shapes, tuple(offsets), -(-total // per_row) * per_row, dtype)


# The engine can multiply q / k / v (and gate / up) in one GEMM over a view of their weights
# (miles/models/fused_projections.py): each group's tensors sort next to each other, in group order.
_GROUPED = {"q_proj": "qkv.0", "k_proj": "qkv.1", "v_proj": "qkv.2", "gate_proj": "gate_up.0", "up_proj": "gate_up.1"}


def _grouped(name: str) -> str:
    module, _, leaf = name.rpartition(".")
    parent, _, projection = module.rpartition(".")
    if projection not in _GROUPED:
        return name
    group, _, index = _GROUPED[projection].partition(".")
    return f"{parent}.{group}.{leaf}.{index}"


class FlatWeights:
    def __init__(self, layout: FlatLayout, buffer: torch.Tensor):
        self.layout, self.buffer = layout, buffer

    @classmethod
    def like(cls, layout: FlatLayout, device: torch.device | str) -> "FlatWeights":
        return cls(layout, torch.zeros(layout.numel, dtype=layout.dtype, device=device))

    @classmethod
    @torch.no_grad()
    def adopt(cls, model: nn.Module) -> "FlatWeights":
        """Move the model's parameters and buffers (one dtype) into one flat buffer; each becomes a
        view of it, so loading the buffer loads the model (and CUDA graphs keep their addresses)."""
        state = model.state_dict()
        dtype = next(iter(state.values())).dtype
        layout = FlatLayout.of(state, dtype)
        flat = cls.like(layout, next(iter(state.values())).device)
        views = flat.views()
        # The module's own tensors (state_dict's are detached aliases); a tied weight appears once.
        owned = dict(model.named_parameters())
        owned.update((n, b) for n, b in model.named_buffers() if n in state)
        if set(owned) != set(views):
            raise ValueError(f"state dict and module tensors differ: {sorted(set(owned) ^ set(views))[:5]}")
        for name, view in views.items():
            view.copy_(owned[name])
            owned[name].data = view
        return flat

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str) -> "FlatWeights":
        """A new buffer on `device` laid out for `tensors`, holding them cast to `dtype`."""
        flat = cls.like(FlatLayout.of(tensors, dtype), device)
        flat.fill_from(tensors)
        return flat

    def views(self) -> dict[str, torch.Tensor]:
        lay = self.layout
        return {name: self.buffer[off: off + _prod(shape)].view(shape)
                for name, shape, off in zip(lay.names, lay.shapes, lay.offsets)}

    def fill_from(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy (and cast) every named tensor into its place; one foreach call for all of them."""
        views = self.views()
        if set(tensors) != set(views):
            raise ValueError(f"weights do not match the flat layout: {sorted(set(tensors) ^ set(views))[:5]}")
        torch._foreach_copy_([views[n] for n in self.layout.names], [tensors[n].detach() for n in self.layout.names])

    def copy_from(self, other: "FlatWeights") -> None:
        if other.layout != self.layout:
            raise ValueError("flat weights of another layout (another model or dtype)")
        self.buffer.copy_(other.buffer, non_blocking=True)

    def checksum(self) -> str:
        """Three int64 reductions over the buffer's 32-bit words seen as [rows, ROW]: the total, the
        row sums weighted by row index, the column sums weighted by column index. Any single
        changed bit changes the total; moved blocks change a weighted sum. An integrity check of
        a copy, not a cryptographic hash."""
        blocks = self.buffer.view(torch.int32).view(-1, ROW).split(BLOCK_BYTES // (ROW * 4))
        return "flat:" + "-".join(f"{v & 0xFFFFFFFFFFFFFFFF:016x}" for v in _word_sums(blocks))


def _word_sums(blocks: Iterable[torch.Tensor]) -> list[int]:
    """The checksums' three int64 reductions of int32 words seen as [rows, ROW], given as consecutive
    [r, ROW] row blocks: the total, the row sums weighted by row index, the column sums weighted by
    column index (wrapping mod 2^64, so any summation order and any blocking give the same digest).
    In blocks because `sum(dtype=int64)` casts its whole input first: over a whole sync payload that
    was twice its size in temporaries (7 GB for 4 of Qwen3-30B-A3B's layers in FP8: out of memory on
    an H100). On the CPU numpy's reductions cast in small buffers (faster: docs/benchmarks.md, "One
    actor for the engine and the trainer")."""
    sums, cols, start = None, None, 0
    for block in blocks:
        if block.device.type == "cpu":
            w = block.numpy()
            rows = torch.from_numpy(np.add.reduce(w, axis=1, dtype=np.int64))
            col = torch.from_numpy(np.add.reduce(w, axis=0, dtype=np.int64))
        else:
            rows, col = block.sum(dim=1, dtype=torch.int64), block.sum(dim=0, dtype=torch.int64)
        index = torch.arange(start + 1, start + rows.numel() + 1, device=rows.device)
        part = torch.stack([rows.sum(), (rows * index).sum()])
        sums, cols = (part, col) if sums is None else (sums + part, cols + col)
        start += rows.numel()
    if sums is None:
        return [0, 0, 0]
    weighted_cols = (cols * torch.arange(1, ROW + 1, device=cols.device)).sum()
    return torch.cat([sums, weighted_cols.view(1)]).tolist()


def _row_blocks(chunks: Iterable[torch.Tensor], block_bytes: int = BLOCK_BYTES) -> Iterator[torch.Tensor]:
    """The concatenation of 1-D uint8 `chunks`, zero-padded to whole rows, as consecutive [r, ROW] int32
    blocks of at most `block_bytes` (a multiple of a row's bytes): one block's copy at a time, never
    the whole concatenation."""
    pending, size = [], 0
    for chunk in chunks:
        pos = 0
        while pos < chunk.numel():
            take = min(chunk.numel() - pos, block_bytes - size)
            pending.append(chunk[pos: pos + take])
            size, pos = size + take, pos + take
            if size == block_bytes:
                yield torch.cat(pending).view(torch.int32).view(-1, ROW)
                pending, size = [], 0
    if size:
        data = torch.nn.functional.pad(torch.cat(pending), (0, -size % (ROW * 4)))
        yield data.view(torch.int32).view(-1, ROW)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


DEVICE_DIGEST = "dev:"


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """FlatWeights.checksum's integrity check for a dict of tensors of any dtypes, computed where
    they live (an in-process quantized sync: FP8 codes, INT4 bytes, fp32 scales on the GPU): the
    names, dtypes and shapes hashed on the host, the bytes (in name order) reduced on the device."""
    names = sorted(tensors)
    meta = hashlib.sha256("|".join(f"{n}:{tensors[n].dtype}:{tuple(tensors[n].shape)}" for n in names).encode())
    chunks = (tensors[n].detach().reshape(-1).view(torch.uint8) for n in names if tensors[n].numel())
    digest = _word_sums(_row_blocks(chunks))  # whole [ROW]-word rows, zero bytes at the end
    return DEVICE_DIGEST + meta.hexdigest()[:16] + "-" + "-".join(f"{v & 0xFFFFFFFFFFFFFFFF:016x}" for v in digest)
