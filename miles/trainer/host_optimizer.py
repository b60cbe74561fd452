"""`trainer.offload_optimizer`: the optimizer state lives in host memory for the whole run.

AdamW's two fp32 moments are 8 of the 16 bytes a trained parameter holds on the device (with its
fp32 master and its fp32 gradient); a Qwen3-4B full fine-tune does not fit an 80 GB GPU with them
there. Here they wait in pinned host memory, and each optimizer step streams them through the
device one bucket of parameters at a time: copy the bucket's state in, run the optimizer's own
step on those parameters only, copy the state back. The step is the configured optimizer's (fused
AdamW: an elementwise kernel), so the parameters come out bit for bit as with the state resident;
the price is the copies, twice the state's bytes per step over PCIe, and one bucket of device memory.

    streamed = HostOptimizerState(optimizer, device)   # after the optimizer is built
    streamed.step()                                    # instead of optimizer.step()
    streamed.park()                                    # after optimizer.load_state_dict (it onloads)

The `step` counts move with the moments (fused AdamW keeps them on the device).
"""

from __future__ import annotations

import torch

from miles.trainer import offload as off

# One bucket's optimizer state on the device at a time: large enough that a copy is at PCIe speed,
# small against the memory the moments free (8 bytes per parameter).
BUCKET_BYTES = 512 * 2**20


class HostOptimizerState:
    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer, self.device = optimizer, torch.device(device)

    def _buckets(self) -> list[tuple[int, list[torch.nn.Parameter]]]:
        """(param group index, its parameters with a gradient), about BUCKET_BYTES of state each
        (two fp32 moments per element: what AdamW holds, and an upper bound for SGD's momentum)."""
        buckets = []
        for index, group in enumerate(self.optimizer.param_groups):
            bucket, size = [], 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                bucket.append(p)
                size += p.numel() * 8
                if size >= BUCKET_BYTES:
                    buckets.append((index, bucket))
                    bucket, size = [], 0
            if bucket:
                buckets.append((index, bucket))
        return buckets

    def _move(self, params: list[torch.nn.Parameter], host: bool) -> None:
        for p in params:
            state = self.optimizer.state.get(p)
            for key, value in (state or {}).items():
                if isinstance(value, torch.Tensor):
                    state[key] = off.to_host(value) if host else off.to_device(value, self.device)

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step, the state brought in and sent back bucket by bucket. The optimizer
        sees one group holding one bucket per call (its hyperparameters are the group's, read at
        this step), so the first step creates each bucket's state on the device, where it starts
        its way to host memory with the bucket's other tensors."""
        groups = self.optimizer.param_groups
        try:
            for index, bucket in self._buckets():
                self._move(bucket, host=False)
                self.optimizer.param_groups = [{**groups[index], "params": bucket}]
                self.optimizer.step()
                self._move(bucket, host=True)
        finally:
            self.optimizer.param_groups = groups
        if self.device.type == "cuda":  # the copies to pinned memory are asynchronous: done before anyone reads them
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def park(self) -> None:
        """Every state tensor to host memory (after load_state_dict, which puts them on the
        parameters' device)."""
        for group in self.optimizer.param_groups:
            self._move(group["params"], host=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
