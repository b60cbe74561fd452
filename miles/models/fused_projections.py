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

Weight-only quantized engines (FP8 w8a16, INT4 W4A16: `QuantLinear` layers): `join_quantized` moves
each group's payload tensors (codes, scales) into one storage, row after row, and makes the layers'
buffers views of it, so syncs (copied in place) reach it too; the group then runs one fused
weight-only kernel (dense copies, miles/precision/dense_copy.py, are joined alike: calls of many rows
multiply the joined copy). FP8 row blocks must not straddle two projections (each but the last a multiple of
128 rows); FP8 w8a8, whose GEMM lays its operand out per layer, stays unfused.

Numerics: each output element is the same dot product; a library may block a wider GEMM differently,
so the sums may differ by reordered fp32 rounding, as between two GEMM libraries. Off by default,
and never under true on-policy (the trainer multiplies the projections one by one).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from miles.precision import dense_copy
from miles.precision.fp8 import BLOCK
from miles.precision.fp8_w8a16_triton import w8a16_linear_auto
from miles.precision.int4_triton import int4_linear_auto
from miles.precision.recipe import FP8, INT4, W8A16, QuantLinear

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
GROUPS = (QKV, GATE_UP)


def _groups(model: nn.Module):
    """(module, its layers) for every whole group in `model`."""
    for module in model.modules():
        for names in GROUPS:
            if all(isinstance(getattr(module, n, None), nn.Module) for n in names):
                yield module, [getattr(module, n) for n in names]


def enable(model: nn.Module) -> int:
    """Mark every module holding a whole group as fused; returns how many groups are one GEMM now."""
    count = 0
    for module, layers in _groups(model):
        module.fuse_projections = True
        count += _fused_product(layers) is not None
    return count


def join_quantized(model: nn.Module) -> int:
    """Weight-only quantized groups of the modules `enable` marked: their payload tensors moved into
    one storage each, the layers' buffers row views of it (one copy; call again after the buffers
    were replaced, e.g. by a release / resume). Returns how many groups were joined."""
    count = 0
    for module, layers in _groups(model):
        if not getattr(module, "fuse_projections", False) or not _joinable(layers):
            continue
        for name in layers[0].held_names():  # the payload, and the dense copies where held
            parts = [getattr(layer, name) for layer in layers]
            joined = torch.cat(parts)
            start = 0
            for layer, part in zip(layers, parts):
                setattr(layer, name, joined[start:start + part.shape[0]])
                start += part.shape[0]
        count += 1
    return count


def project(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    layers = [getattr(module, n) for n in names]
    if getattr(module, "fuse_projections", False):
        product = _fused_product(layers)
        if product is not None:
            return product(x).split([layer.out_features for layer in layers], dim=-1)
    return tuple(layer(x) for layer in layers)


def _hooked(layer: nn.Module) -> bool:
    return bool(layer._forward_hooks or layer._forward_pre_hooks)


def _weight_only(layers: list[nn.Module]) -> bool:
    """QuantLinear layers of one weight-only format (FP8 w8a16 or INT4) and group, without hooks."""
    first = layers[0]
    return all(type(layer) is QuantLinear and not _hooked(layer) and layer.quant == first.quant
               and layer.fp8_scheme == first.fp8_scheme and layer.group == first.group
               and layer.in_features == first.in_features for layer in layers) \
        and (first.quant == INT4 or (first.quant == FP8 and first.fp8_scheme == W8A16))


def _joinable(layers: list[nn.Module]) -> bool:
    if not _weight_only(layers) or any(layer.bias is not None for layer in layers):
        return False
    if any(getattr(layer, name).numel() == 0 for layer in layers for name in layer.held_names()):
        return False  # placeholders: nothing loaded yet
    if len({layer.held_names() for layer in layers}) > 1:
        return False
    return layers[0].quant != FP8 or all(layer.out_features % BLOCK == 0 for layer in layers[:-1])


def _fused_product(layers: list[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The group's product as one GEMM over views of its adjacent weights, or None."""
    if all(type(layer) is nn.Linear and not _hooked(layer) for layer in layers):
        weight = _joined([layer.weight for layer in layers])
        if weight is None:
            return None
        if all(layer.bias is None for layer in layers):
            return lambda x: F.linear(x, weight)
        bias = _joined([layer.bias for layer in layers]) if all(layer.bias is not None for layer in layers) else None
        return None if bias is None else (lambda x: F.linear(x, weight, bias))
    if not _weight_only(layers) or any(layer.bias is not None for layer in layers):
        return None
    payload = [_joined([getattr(layer, name) for layer in layers]) for name in layers[0].buffer_names()]
    if any(t is None for t in payload):
        return None
    if layers[0].quant == INT4:
        product = lambda x: int4_linear_auto(x, payload[0], payload[1], layers[0].group)  # noqa: E731
    else:
        product = lambda x: w8a16_linear_auto(x, payload[0], payload[1])  # noqa: E731
    dense = _joined([layer.dense for layer in layers]) if "dense" in layers[0].held_names() else None
    if dense is None:
        return product
    return lambda x: F.linear(x, dense) if dense_copy.applies(x, dense) else product(x)


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
