"""Trainer offload for colocation, and the device memory figures the loop logs per phase.

With `rollout.colocate=true` the trainer and the engine share the GPU and take turns: while the
engine generates, the trainer's state waits in host memory (`TorchTrainer.offload` / `onload`, tags
"params", "grads", "optimizer"):
- "params": every parameter and buffer of the policy, the KL reference and the teacher, to pinned
  host memory and back. Their `.data` moves, so the nn.Parameter objects (which the optimizer holds)
  stay the same; a gradient still attached moves with its parameter.
- "grads": dropped (set to None), not copied: every optimizer step begins with
  `zero_grad(set_to_none=True)`, so a gradient is never read after the step that made it.
- "optimizer": every tensor of the optimizer state (AdamW's exp_avg / exp_avg_sq, and its `step`
  where that lives on the device) to pinned host memory, back to the device it came from.
On the CPU nothing moves (the state is in host memory already) except the dropped gradients.

    stats = memory_stats("cuda", reset_peak=True)   # before a phase: opens a new peak window
    ...                                              # the phase (generate, train_rl)
    stats = memory_stats("cuda")                     # stats.peak_gb: the phase's peak
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PARAMS, GRADS, OPTIMIZER = "params", "grads", "optimizer"
TRAINER_TAGS = (PARAMS, GRADS, OPTIMIZER)
GB = 2**30

# Tests: move into fresh host tensors even on the CPU, so that the CPU exercises the re-pointing
# (parameters, optimizer state, FSDP's sharded storage) that a GPU offload does.
FORCE_COPY = False


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


def check_tags(tags, who: str) -> tuple[str, ...]:
    """`tags` as a tuple (one string is one tag); a ValueError naming the valid ones otherwise."""
    tags = (tags,) if isinstance(tags, str) else tuple(tags)
    unknown = [t for t in tags if t not in TRAINER_TAGS]
    if unknown:
        raise ValueError(f"{who}: unknown offload tag(s) {unknown}; valid: {', '.join(TRAINER_TAGS)}")
    return tags


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`, pinned when it is on CUDA (asynchronous: `free_device_memory` waits);
    a host tensor as it is (a fresh copy with FORCE_COPY). DTensors (FSDP's optimizer state) move
    their local shard with DTensor.to (pageable host memory)."""
    if t.device.type == "cpu":
        return t.clone() if FORCE_COPY else t
    if _is_dtensor(t):
        return t.to("cpu")
    host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=True)
    return host


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` with its strides (itself when it is there, a fresh copy with FORCE_COPY)."""
    if same_device(t.device, device):
        return t.clone() if FORCE_COPY else t
    if _is_dtensor(t):
        return t.to(device)
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    out.copy_(t, non_blocking=True)
    return out


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


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's parameters and buffers, each once."""
    return [*module.parameters(), *module.buffers()]


@torch.no_grad()
def move_module(module: torch.nn.Module, device: torch.device, host: bool) -> None:
    """Parameters and buffers of a plain (unsharded) module to host memory (`host`) or to `device`,
    in place: `.data` moves, the tensor objects stay. A gradient moves with its parameter."""
    for t in _tensors(module):
        grad = t.grad if isinstance(t, torch.nn.Parameter) else None
        if grad is not None:
            t.grad = None  # set back after .data moved: a gradient must be on its parameter's device
        t.data = to_host(t.data) if host else to_device(t.data, device)
        if grad is not None:
            t.grad = to_host(grad) if host else to_device(grad, device)


@torch.no_grad()
def offload_optimizer(optimizer: torch.optim.Optimizer) -> list[tuple[dict, str, torch.device]]:
    """Every tensor of the optimizer state to host memory; returns (state, key, device it was on),
    what `onload_optimizer` needs to put each one back."""
    moved = []
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                moved.append((state, key, value.device))
                state[key] = to_host(value)
    return moved


@torch.no_grad()
def onload_optimizer(moved: list[tuple[dict, str, torch.device]]) -> None:
    for state, key, device in moved:
        state[key] = to_device(state[key], device)


def state_bytes(tensors) -> int:
    """Bytes of these tensors (DTensors: their local shards)."""
    total = 0
    for t in tensors:
        local = t.to_local() if _is_dtensor(t) else t
        total += local.numel() * local.element_size()
    return total
