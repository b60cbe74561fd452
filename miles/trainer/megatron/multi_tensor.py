"""Multi-tensor gradient norm and scale for megatron-core without Apex or Transformer Engine.

megatron-core's optimizer computes the gradient norm (clip_grads.get_grad_norm_fp32) and scales the
gradients (clipping; the distributed optimizer's main <-> model copies) through
`multi_tensor_applier(l2_norm_impl / multi_tensor_scale_impl, ...)`. Without Apex or TE it falls
back to `local_multi_tensor_l2_norm`, which builds `torch.tensor([norm of each gradient])` from
device scalars: one host sync per gradient tensor (Megatron's 0.6B step profiled on an H100 made 234
host syncs, docs/benchmarks.md), and to `local_multi_tensor_scale`, two kernels and a temporary per tensor.
These keep the contracts (amp_C.multi_tensor_l2norm: the l2 norm of every tensor together as a [1]
fp32 device tensor, and no per-tensor norms; amp_C.multi_tensor_scale: dst = src * scale) with
torch's foreach kernels: no host sync, a few launches for all tensors.

    multi_tensor.install()   # once per process, before the first step (MegatronTrainer does)
"""

from __future__ import annotations

import torch


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """(the l2 norm of all tensors of tensor_lists[0] as a [1] fp32 tensor on their device, None)."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device="cuda"), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """dst = src * scale for each (src, dst) pair; in place where they are the same tensors."""
    src, dst = tensor_lists
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def install() -> bool:
    """Put the foreach versions where megatron-core fell back to its local ones (Apex's or TE's stay).
    Returns whether anything was replaced."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    replaced = False
    for module in (clip_grads, optimizer):
        if getattr(module, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
            module.l2_norm_impl = foreach_l2_norm
            replaced = True
        if getattr(module, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
            replaced = True
    return replaced
