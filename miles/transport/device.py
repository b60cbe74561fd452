"""Device helpers both sides of a weight sync use: which device is which, handing cached memory back,
and the allocator's figures. Torch only, so the engine (miles/rollout/) and the trainer
(miles/trainer/) import them from this floor instead of from each other.

    stats = memory_stats("cuda", reset_peak=True)   # before a phase: opens a new peak window
    ...                                              # the phase (generate, train_rl)
    stats = memory_stats("cuda")                     # stats.peak_gb: the phase's peak
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 2**30


@dataclass(frozen=True)
class MemoryStats:
    """Device bytes of the caching allocator: handed out now, the most since the last peak reset,
    and held from the driver (allocated + cached)."""
    allocated: int = 0
    peak: int = 0
    reserved: int = 0

    @property
    def allocated_gb(self) -> float:
        return self.allocated / GB

    @property
    def peak_gb(self) -> float:
        return self.peak / GB


def memory_stats(device: torch.device | str | None = None, reset_peak: bool = False) -> MemoryStats:
    """Allocated / peak / reserved bytes on a CUDA `device` (None: the current CUDA device, if any);
    all zeros for a CPU device or without CUDA. `reset_peak`: after reading, start a new peak window
    (torch.cuda.reset_peak_memory_stats), so the next call's `peak` is that of what ran in between."""
    device = torch.device(device) if device is not None else None
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return MemoryStats()
    stats = MemoryStats(torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device),
                        torch.cuda.memory_reserved(device))
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return stats


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one ("cuda" is the current CUDA device)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def free_device_memory(device: torch.device) -> None:
    """Wait for the copies in flight, then hand the allocator's cached blocks back to the driver."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
