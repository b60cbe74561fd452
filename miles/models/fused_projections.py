"""q / k / v and gate / up as one GEMM each in the engine, over a view of their adjacent weights.

    fused_projections.enable(model)          # the engine, on CUDA (rollout.fuse_projections)
    q, k, v = project(attn, QKV, x)          # Attention.forward: one F.linear, split; else three

A decode step at 64 rows of a Qwen3-4B shape ran 7 GEMMs a layer, the k / v ones [64, 2560] x [2560,
1024] too small to fill the GPU (docs/benchmarks.md, "Where a decode step goes"). The engine's flat
weight buffer lays each group's weights (and biases) out adjacently (miles/transport/flat.py), so
the group's weight is a view of the buffer, [sum of outs, in], with no copy: a weight sync, a
release / resume of the buffer and the LoRA merge (in place) all reach it. `project` builds the view
at each call from the projections as they are now, and falls back to one call per projection when
they are not adjacent plain nn.Linear layers of one dtype, or carry hooks (unmerged LoRA adapters).

Numerics: each output element is the same dot product; a library may block a wider GEMM differently,
so the sums may differ by reordered fp32 rounding, as between two GEMM libraries. Off by default,
and never under true on-policy (the trainer multiplies the projections one by one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
GROUPS = (QKV, GATE_UP)


def enable(model: nn.Module) -> int:
    """Mark every module holding a whole group as fused; returns how many groups are adjacent now."""
    count = 0
    for module in model.modules():
        for names in GROUPS:
            if all(isinstance(getattr(module, n, None), nn.Module) for n in names):
                module.fuse_projections = True
                count += _adjacent([getattr(module, n) for n in names]) is not None
    return count


def project(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    linears = [getattr(module, n) for n in names]
    if getattr(module, "fuse_projections", False):
        fused = _adjacent(linears)
        if fused is not None:
            weight, bias = fused
            return F.linear(x, weight, bias).split([lin.out_features for lin in linears], dim=-1)
    return tuple(lin(x) for lin in linears)


def _adjacent(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(the group's weight, its bias or None) as views, or None when the layers cannot be one GEMM."""
    if not all(type(lin) is nn.Linear and not lin._forward_hooks and not lin._forward_pre_hooks for lin in linears):
        return None
    weight = _joined([lin.weight for lin in linears])
    if weight is None:
        return None
    if all(lin.bias is None for lin in linears):
        return weight, None
    bias = _joined([lin.bias for lin in linears]) if all(lin.bias is not None for lin in linears) else None
    return None if bias is None else (weight, bias)


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over tensors that lie back to back in one storage (rows of a 2-D weight, or 1-D biases)."""
    first = tensors[0]
    trailing = first.shape[1:]
    if any(t.dtype != first.dtype or t.device != first.device or t.shape[1:] != trailing or not t.is_contiguous()
           or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in tensors):
        return None
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *trailing), first.stride())
