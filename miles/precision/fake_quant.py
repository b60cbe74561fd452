"""Fake quantization with a straight-through estimator, for the training forward (FP8 and INT4 QAT).

forward(w) = dequantize(quantize(w)) through the very functions the rollout side uses, so the
trainer's forward weights are bit for bit the weights the engine rebuilds from the synced format;
backward = identity (the upstream gradient passes through unchanged, including through the clamp:
the scale follows the block amax, so nothing in a block is ever clipped).

An autograd.Function rather than `w + (fq(w) - w).detach()`: that trick rounds twice and its
forward value need not equal fq(w) exactly, which would break train / rollout bitwise agreement.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.precision.fp8 import BLOCK, dequantize_fp8_act, dequantize_fp8_weight, quantize_fp8_act, quantize_fp8_weight
from miles.precision.int4 import dequantize_int4, pack_int4, quantize_int4


class _FakeQuantFP8Weight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
        ctx.in_dtype = w.dtype
        q, s = quantize_fp8_weight(w, block)
        return dequantize_fp8_weight(q, s, dtype, block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.in_dtype), None, None


class _FakeQuantFP8Act(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tile: int, dtype: torch.dtype) -> torch.Tensor:
        ctx.in_dtype = x.dtype
        q, s = quantize_fp8_act(x, tile)
        return dequantize_fp8_act(q, s, dtype, tile)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.in_dtype), None, None


class _FakeQuantInt4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
        ctx.in_dtype = w.dtype
        # Through pack / unpack on purpose: the engine runs the packed bytes, so must we.
        q, s = quantize_int4(w, group)
        return dequantize_int4(pack_int4(q), s, group, k=w.shape[-1], dtype=dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.in_dtype), None, None


def fake_quant_fp8_weight(w: torch.Tensor, block: int = BLOCK, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., N, K] -> [..., N, K] in `dtype` (default w.dtype): 128x128-block FP8 round trip forward,
    identity backward. Passing the compute dtype here (not .to() afterwards) rounds once, as the engine does."""
    return _FakeQuantFP8Weight.apply(w, block, dtype or w.dtype)


def fake_quant_fp8_act(x: torch.Tensor, tile: int = BLOCK, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., K] -> [..., K] in `dtype` (default x.dtype): 1x128-tile FP8 round trip forward, identity backward."""
    return _FakeQuantFP8Act.apply(x, tile, dtype or x.dtype)


def fake_quant_int4(w: torch.Tensor, group: int = 128, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., N, K] -> [..., N, K] in `dtype` (default w.dtype): W4 group round trip forward, identity
    backward (QAT)."""
    return _FakeQuantInt4.apply(w, group, dtype or w.dtype)


def fake_fp8_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                    quantize_act: bool = True) -> torch.Tensor:
    """Training-side FP8 linear: x [..., K], w [N, K] -> [..., N] in x.dtype.

    Equals fp8_linear(x, *quantize_fp8_weight(w), backend="emulated") bitwise (the same quantizers,
    the same F.linear); gradients flow to x and w straight through.
    """
    xq = fake_quant_fp8_act(x) if quantize_act else x
    return F.linear(xq, fake_quant_fp8_weight(w, dtype=x.dtype), bias)


def fake_int4_linear(x: torch.Tensor, w: torch.Tensor, group: int = 128,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Training-side W4A16 linear (QAT), x [..., K], w [N, K] -> [..., N]: equals int4_linear on the
    packed weight bitwise."""
    return F.linear(x, fake_quant_int4(w, group, dtype=x.dtype), bias)
