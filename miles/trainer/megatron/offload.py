"""Colocation offload of the Megatron-core trainer (`trainer.offload`, tags as the torch trainer's:
miles/trainer/offload.py), through the storage of megatron-core's own buffers so that every view of
them (each parameter, each gradient, the fp32 main parameters that alias them) stays valid:

- "params": DistributedDataParallel's parameter buffers go to pinned host copies and their storage is
  freed (megatron-core's `offload_to_cpu`, the hook it keeps for RL); the KL reference (a plain
  GPTModel) moves like the torch trainer's models, and so do the policy's frozen parameters, which no
  buffer holds (the LoRA base: DDP buffers only what requires grad).
- "grads": the gradient buffers' storage is freed, not copied (each step zeroes them first); they
  come back, zeroed, before the next step.
- "optimizer": the Adam moments move like the torch trainer's; the fp32 main parameters that have a
  storage of their own (bf16 training) go to host copies and their storage is freed. With fp32
  parameters the main parameters are views of the parameter buffers: "params" moves those.
"""

from __future__ import annotations

import torch

from miles.trainer import offload as off
from miles.trainer.megatron.held_base import held_tensors


class MegatronOffload:
    def __init__(self, ddp_model, ref_model, optimizers, device: torch.device):
        """`ddp_model`: the policy's DistributedDataParallel; `optimizers`: megatron-core's distributed
        optimizers (each with its torch optimizer in `.optimizer`)."""
        self.ddp, self.ref_model, self.optimizers, self.device = ddp_model, ref_model, optimizers, device
        # Parameters outside DDP's buffers (frozen: the LoRA base, or its codes and scales under QLoRA:
        # held_base.py); moved by .data like the reference.
        self._frozen = [p for p in ddp_model.module.parameters() if not p.requires_grad]
        self._frozen += held_tensors(ddp_model.module)
        self.offloaded: set[str] = set()
        self._moments: list = []  # what off.offload_optimizer moved, to put back
        self._main_host: list[torch.Tensor] = []

    def _buffers(self) -> list:
        return [*self.ddp.buffers, *self.ddp.expert_parallel_buffers]

    def _main_params(self) -> list[torch.Tensor]:
        """The optimizers' main parameters with a storage of their own (not views of a parameter buffer)."""
        buffers = {b.param_data.untyped_storage().data_ptr() for b in self._buffers() if b.param_data is not None}
        return [p for o in self.optimizers for g in o.optimizer.param_groups for p in g["params"]
                if p.untyped_storage().data_ptr() not in buffers]

    @torch.no_grad()
    def offload(self, tags) -> None:
        tags = off.check_tags(tags, "offload")
        if off.GRADS in tags and off.GRADS not in self.offloaded:
            for buffer in self._buffers():
                buffer.offload_to_cpu(move_params=False, move_grads=True)
            self.offloaded.add(off.GRADS)
        if off.OPTIMIZER in tags and off.OPTIMIZER not in self.offloaded:
            self._moments = [moved for o in self.optimizers for moved in off.offload_optimizer(o.optimizer)]
            mains = self._main_params()
            # a copy even on the CPU: the storage is freed below
            self._main_host = [p.clone() if p.device.type == "cpu" else off.to_host(p) for p in mains]
            for p in mains:
                p.untyped_storage().resize_(0)
            self.offloaded.add(off.OPTIMIZER)
        if off.PARAMS in tags and off.PARAMS not in self.offloaded:
            for buffer in self._buffers():
                buffer.offload_to_cpu(move_params=True, move_grads=False)
            if self.ref_model is not None:
                off.move_module(self.ref_model, self.device, host=True)
            for p in self._frozen:
                p.data = off.to_host(p.data)
            self.offloaded.add(off.PARAMS)
        off.free_device_memory(self.device)

    @torch.no_grad()
    def onload(self, tags) -> None:
        tags = off.check_tags(tags, "onload")
        if off.PARAMS in tags and off.PARAMS in self.offloaded:
            for buffer in self._buffers():
                buffer.reload_from_cpu(move_params=True, move_grads=False)
            if self.ref_model is not None:
                off.move_module(self.ref_model, self.device, host=False)
            for p in self._frozen:
                p.data = off.to_device(p.data, self.device)
            self.offloaded.discard(off.PARAMS)
        if off.OPTIMIZER in tags and off.OPTIMIZER in self.offloaded:
            off.onload_optimizer(self._moments)
            for p, host in zip(self._main_params(), self._main_host, strict=True):
                p.untyped_storage().resize_(host.numel() * host.element_size())
                p.copy_(host)
            self._moments, self._main_host = [], []
            self.offloaded.discard(off.OPTIMIZER)
        if off.GRADS in tags:
            self.restore_grads()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def restore_grads(self) -> None:
        """The gradient buffers back (zeroed) if "grads" was offloaded: before any backward."""
        if off.GRADS in self.offloaded:
            for buffer in self._buffers():
                buffer.reload_from_cpu(move_params=False, move_grads=True)
            self.offloaded.discard(off.GRADS)

    def bytes(self) -> dict[str, int]:
        """Device bytes `offload` would free now, per tag (0 for what is offloaded already)."""
        here = lambda ts: [t for t in ts if off.same_device(t.device, self.device)  # noqa: E731
                           and t.untyped_storage().size() > 0]
        params = [b.param_data for b in self._buffers() if b.param_data is not None]
        params += self._frozen
        if self.ref_model is not None:
            params += [*self.ref_model.parameters(), *self.ref_model.buffers()]
        grads = [b.grad_data for b in self._buffers() if b.grad_data is not None]
        moments = [v for o in self.optimizers for s in o.optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor)]
        return {off.PARAMS: off.state_bytes(here(params)) if off.PARAMS not in self.offloaded else 0,
                off.GRADS: off.state_bytes(here(grads)) if off.GRADS not in self.offloaded else 0,
                off.OPTIMIZER: (off.state_bytes(here(moments + self._main_params()))
                                if off.OPTIMIZER not in self.offloaded else 0)}
