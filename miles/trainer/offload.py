"""Trainer offload for colocation.

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
The device helpers the engine shares (same_device, free_device_memory, memory_stats) live a floor
down, in miles/transport/device.py.
"""

from __future__ import annotations

import torch

from miles.transport.device import free_device_memory, same_device  # noqa: F401  (the trainers call off.free_device_memory)

PARAMS, GRADS, OPTIMIZER = "params", "grads", "optimizer"
TRAINER_TAGS = (PARAMS, GRADS, OPTIMIZER)

# Tests: move into fresh host tensors even on the CPU, so that the CPU exercises the re-pointing
# (parameters, optimizer state, FSDP's sharded storage) that a GPU offload does.
FORCE_COPY = False


def check_tags(tags, who: str) -> tuple[str, ...]:
    """`tags` as a tuple (one string is one tag); a ValueError naming the valid ones otherwise."""
    tags = (tags,) if isinstance(tags, str) else tuple(tags)
    unknown = [t for t in tags if t not in TRAINER_TAGS]
    if unknown:
        raise ValueError(f"{who}: unknown offload tag(s) {unknown}; valid: {', '.join(TRAINER_TAGS)}")
    return tags


def require_onloaded(offloaded: set[str], what: str, needed: tuple[str, ...] = (PARAMS, OPTIMIZER)) -> None:
    """A RuntimeError naming onload when any of `needed` is in `offloaded` (`what` needs them)."""
    missing = tuple(t for t in needed if t in offloaded)
    if missing:
        raise RuntimeError(f"{what}: the trainer's {' and '.join(missing)} are offloaded to host memory "
                           f"(colocation): call onload({missing}) first")


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
