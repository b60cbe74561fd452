"""Colocation memory phases of the native engine: its weights and its KV / slot cache leave the device.

With `rollout.colocate=true` the engine and the trainer share the GPU and take turns; the loop calls
SGLang's pair of methods on the engine (`NativeEngine.release_memory` / `resume_memory`, tags
"weights" and "kv_cache"). This module moves the weights (`EngineWeights`); the slot cache is
`SlotDecoder.release` / `allocate` (miles/rollout/slots.py).

Weights, two ways (`release(keep=...)`):
- keep (the default): a host copy, pinned on CUDA, and back at resume. Safe in any call order (a
  generate right after resume needs no sync); costs host memory of the weights' size and one
  device-to-host copy per release (plus one host-to-device copy per resume).
- drop (`keep=False`): nothing is copied; resume allocates zeros on the device and the engine
  refuses to generate until the next `update_weights` fills them. What the colocated RL loop wants
  (it syncs after every resume anyway): no host memory, no copy at release.

The engine's plain weights live in one flat buffer (miles/transport/flat.py) whose views are the
parameters: the buffer moves as one tensor and the parameters are re-pointed at views of the new
one (same layout, same offsets). A quantized rollout (FP8 / INT4 payload tensors) moves each
parameter and buffer on its own. On the CPU a kept copy is the tensor itself: nothing moves.
"""

from __future__ import annotations

import torch
from torch import nn

from miles.transport.device import same_device
from miles.transport.flat import FlatWeights

WEIGHTS, KV_CACHE = "weights", "kv_cache"
ENGINE_TAGS = (WEIGHTS, KV_CACHE)


def check_tags(tags, valid: tuple[str, ...], who: str) -> tuple[str, ...]:
    """`tags` as a tuple (one string is one tag); a ValueError naming the valid ones otherwise."""
    tags = (tags,) if isinstance(tags, str) else tuple(tags)
    unknown = [t for t in tags if t not in valid]
    if unknown:
        raise ValueError(f"{who}: unknown memory tag(s) {unknown}; valid: {', '.join(valid)}")
    return tags


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor (asynchronous: synchronize before reading it); a host
    tensor as it is."""
    if t.device.type == "cpu":
        return t
    host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=True)
    return host


def device_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` with its strides (itself when it is there already)."""
    if same_device(t.device, device):
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    out.copy_(t, non_blocking=True)
    return out


def _placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` with no memory behind it (one zero, broadcast): what a dropped weight is."""
    return torch.zeros((), dtype=dtype).expand(shape)


def _module_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers by name (a shared one once)."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return tensors


def _rebind(model: nn.Module, data: dict[str, torch.Tensor]) -> None:
    """Point each named parameter / buffer at its new data (the same tensor objects stay)."""
    owned = _module_tensors(model)
    for name, t in data.items():
        owned[name].data = t


class EngineWeights:
    """The engine's weights on and off the device (`flat`: the engine's FlatWeights, or None when it
    holds a quantized rollout format; `pausable`: the engine's pausable memory, whose "weights" region
    holds the flat buffer (rollout.memory_saver): then the buffer keeps its address through a release,
    and so do the views the decode graphs captured)."""

    def __init__(self, model: nn.Module, flat: FlatWeights | None, device: torch.device, pausable=None):
        if pausable is not None and flat is None:
            raise ValueError("pausable engine weights need the flat buffer (plain weights, not a quantized format)")
        self.model, self.flat, self.device, self.pausable = model, flat, device, pausable
        self.released = False
        self.stale = False  # zeros since a dropping release: update_weights must fill them first
        self._host = None  # while released with keep: the host copy (flat buffer, or per-tensor dict)
        self._specs: dict[str, tuple] = {}  # while released, per tensor: (shape, stride, dtype)

    def nbytes(self) -> int:
        """Bytes of the weights on the device now (0 while released)."""
        if self.released:
            return 0
        if self.flat is not None:
            return self.flat.buffer.numel() * self.flat.buffer.element_size()
        tensors = {id(t): t for t in _module_tensors(self.model).values()}.values()
        return sum(t.numel() * t.element_size() for t in tensors if same_device(t.device, self.device))

    def release(self, keep: bool = True) -> None:
        if self.released:
            return
        if self.pausable is not None:  # the pause loses the contents: keep needs a copy of its own
            buffer = self.flat.buffer
            self._host = (host_copy(buffer) if buffer.is_cuda else buffer.clone()) if keep else None
            self.pausable.pause(WEIGHTS)  # synchronizes first: the host copy is complete
        elif self.flat is not None:
            buffer = self.flat.buffer
            self._specs = {"": (tuple(buffer.shape), buffer.stride(), buffer.dtype)}
            if keep:
                self._host = self.flat.buffer = host_copy(buffer)
                _rebind(self.model, self.flat.views())
            else:
                self._host = None
                self.flat.buffer = _placeholder(buffer.shape, buffer.dtype)
                lay = self.flat.layout
                _rebind(self.model, {n: _placeholder(s, lay.dtype) for n, s in zip(lay.names, lay.shapes)})
        else:
            tensors = _module_tensors(self.model)
            self._specs = {n: (tuple(t.shape), t.stride(), t.dtype) for n, t in tensors.items()}
            self._host = {n: host_copy(t.data) for n, t in tensors.items()} if keep else None
            _rebind(self.model, self._host if keep else
                    {n: _placeholder(shape, dtype) for n, (shape, _, dtype) in self._specs.items()})
        self.released = True

    def resume(self) -> None:
        if not self.released:
            return
        if self.pausable is not None:
            self.pausable.resume(WEIGHTS)
            if self._host is not None:
                self.flat.buffer.copy_(self._host, non_blocking=True)
        elif self.flat is not None:
            if self._host is not None:
                self.flat.buffer = device_copy(self._host, self.device)
            else:
                shape, _, dtype = self._specs[""]
                self.flat.buffer = torch.zeros(shape, dtype=dtype, device=self.device)
            _rebind(self.model, self.flat.views())
        elif self._host is not None:
            _rebind(self.model, {n: device_copy(h, self.device) for n, h in self._host.items()})
        else:
            _rebind(self.model, {n: torch.empty_strided(shape, stride, dtype=dtype, device=self.device).zero_()
                                 for n, (shape, stride, dtype) in self._specs.items()})
        self.stale = self._host is None
        self._host, self._specs = None, {}
        self.released = False
