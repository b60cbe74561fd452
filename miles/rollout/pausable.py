"""Engine memory that leaves the GPU and comes back at the same addresses (`rollout.memory_saver`).

A colocated engine gives its weights and slot cache back for the trainer's turn. Memory from
PyTorch's allocator comes back elsewhere, so the decode graphs, captured at the old addresses, are
captured again at every resume: 2.3-2.6 s of each colocated step on an H100 (docs/benchmarks.md).
With `rollout.memory_saver=true` the engine allocates its plain weights and its slot cache through
torch_memory_saver (SGLang's library for `--enable-memory-saver`), in its in-process "torch" mode (a
pluggable allocator over CUDA virtual memory: no LD_PRELOAD): a pause unmaps the physical memory and
keeps the virtual range, a resume maps new memory at the same addresses, so the graphs stay valid.

The contents do not survive a pause: the weights are refilled by the next sync (the engine refuses
to generate until then, as after any dropping release) and the cache is zeroed at resume (every
slot empty, and no NaN bit patterns in the columns attention masks). What must survive (the per-slot state the graphs read, the graphs' own memory pool) is
allocated outside the regions and stays on the device.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

INSTALL = "pip install torch_memory_saver (a CUDA build: its wheel carries CUDA 12 and 13 binaries)"


class PausableMemory:
    """Tagged regions of device memory: `region(tag)` allocates in one, `pause(tag)` / `resume(tag)`."""

    def __init__(self, saver, device: torch.device):
        self.saver, self.device = saver, device
        self.paused: set[str] = set()

    @contextmanager
    def region(self, tag: str):
        with self.saver.region(tag=tag):
            yield

    def pause(self, tag: str) -> None:
        if tag not in self.paused:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no kernel may still read the memory being unmapped
            self.saver.pause(tag)
            self.paused.add(tag)

    def resume(self, tag: str) -> None:
        if tag in self.paused:
            self.saver.resume(tag)
            self.paused.discard(tag)


def load(enabled: bool, device: torch.device) -> PausableMemory | None:
    """The engine's pausable memory where `rollout.memory_saver` asks for it (None where it does not);
    a clear error where it cannot work."""
    if not enabled:
        return None
    if device.type != "cuda":
        raise ValueError(f"rollout.memory_saver=true pauses CUDA memory; this engine runs on {device.type}: "
                         "set rollout.memory_saver=false")
    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError as error:
        raise RuntimeError(f"rollout.memory_saver=true needs torch_memory_saver ({error}): {INSTALL}, "
                           "or set rollout.memory_saver=false") from error
    try:
        torch_memory_saver.hook_mode = "torch"  # in-process allocator; settable only before its first use
    except (AssertionError, AttributeError):
        pass  # already initialised in this process (an earlier engine): its mode stays
    return PausableMemory(torch_memory_saver, device)
