"""Megatron-core on the CPU, for tests only: what cannot exist here (CUDA) is mapped to the CPU.

megatron-core 0.19.2 (the GPU machine's version) builds GPTModel, its DistributedDataParallel and
its distributed optimizer with CUDA hard-coded in a few places (`torch.cuda.current_device()` as a
device, `device='cuda'` buffers, a CUDA RNG tracker around dropout, CUDA streams and events, a
`torch.cuda.FloatTensor` type check, pinned host copies). `cuda_on_cpu()` maps those to the CPU
while it is active: factory calls and `.to` / `.cuda` with a CUDA device go to the CPU,
`pin_memory` makes an (unpinned) copy as it does on CUDA, `Tensor.type()` names the CUDA type, the
RNG tracker's fork is a no-op (the tiny models have no dropout), and so is restoring the CUDA RNG
state around a recomputed layer, streams and events are no-ops (the
CPU runs in order), `torch.cuda.{get,set}_rng_state` use the CPU generator. The trainer's own code
runs unchanged, on gloo instead of NCCL (`init_parallel_gloo`). Everything else (the model,
Megatron's optimizer, gradient buffers and router hooks, the project's losses) is real."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode


def _cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):  # a CUDA ordinal
        return "cpu"
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.pin_memory:  # a page-locked copy, as on CUDA (the page-locking is CUDA's)
            return args[0].clone()
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # Megatron's dtype check
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


class _Event:
    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass


class _Stream:
    """A CUDA stream on the CPU: work is already ordered, so waits and events are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self):
        pass


_CURRENT = _Stream()


def init_parallel_gloo(device, tp: int = 1, ep: int = 1, seed: int = 0) -> None:
    """miles.trainer.megatron.trainer.init_parallel on gloo: one process, Megatron's groups of size 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)


@contextlib.contextmanager
def cuda_on_cpu():
    from megatron.core.tensor_parallel import random as megatron_random

    import miles.trainer.megatron.trainer as megatron_trainer

    with contextlib.ExitStack() as stack:
        for target, value in [
            ("torch.cuda.current_device", lambda: "cpu"),
            ("torch.cuda.synchronize", lambda *a, **k: None),
            ("torch.cuda.get_rng_state", lambda *a, **k: torch.get_rng_state()),
            ("torch.cuda.set_rng_state", lambda *a, **k: None),
            # the RNG states megatron-core's full recompute saves and restores around each layer
            ("torch.cuda.random.get_rng_state", lambda *a, **k: torch.get_rng_state()),
            ("megatron.core.tensor_parallel.random._set_cuda_rng_state", lambda *a, **k: None),
            ("torch.cuda.Stream", _Stream),
            ("torch.cuda.current_stream", lambda *a, **k: _CURRENT),
            ("torch.cuda.stream", lambda *a, **k: contextlib.nullcontext()),
            ("torch.cuda.is_current_stream_capturing", lambda: False),
        ]:
            stack.enter_context(mock.patch(target, value))
        stack.enter_context(mock.patch.object(megatron_random.CudaRNGStatesTracker, "fork",
                                              lambda self, *a, **k: contextlib.nullcontext()))
        stack.enter_context(mock.patch.object(megatron_trainer, "init_parallel", init_parallel_gloo))
        stack.enter_context(_CudaToCpu())
        yield
