"""The training side of an FP8 nn.Linear: the engine's FP8 GEMM forward, a bf16 or an FP8 backward.

    cache = FP8WeightCache()
    y = fp8_train_linear(x, linear.weight, linear.bias, cache)   # x [..., K] -> [..., N]   (fp8_scheme w8a8)
    w = straight_through_dequantized(linear.weight, cache, torch.bfloat16)  # F.linear(x, w)   (w8a16)
    y = w8a16_train_linear(x, linear.weight, linear.bias, cache)  # w8a16 with precision.fp8_backward=fp8

Forward: the master weight is quantized (128x128 blocks, `quantize_fp8_weight`) once per optimizer
step (the cache keys on the parameter's storage and version), the input in 1x128 tiles, and the
product is the engine's own `gemm_quantized` on the backend the engine resolves (`torch._scaled_mm`
on Hopper, DeepGEMM where it loads, the emulated GEMM on the CPU). So a layer gives the engine's
bits for the same input, instead of a bf16 GEMM of dequantized operands that rounds differently
(the cause of the fp8 recipe's train / rollout mismatch on the GPU, docs/precision.md).

Backward, in the compute dtype (bf16 under autocast), straight through the quantizers:
grad_x = grad_y @ dequant(W), grad_W = grad_y^T @ dequant(x) (the dequantized 1x128 activations the
forward multiplied, saved as fp8 codes + scales: half the bytes of bf16 activations). Master
weights and the optimizer are unchanged. With `precision.fp8_backward=fp8` both products run in FP8
instead, DeepSeek-V3's tiling (miles/precision/fp8_backward.py): W^T's codes and scales are one more
product of the weight's quantization, cached beside the others (1 byte a parameter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.precision.fp8 import dequantize_fp8_act, dequantize_fp8_weight, quantize_fp8_weight
from miles.precision.fp8_backward import TransposedFP8Weight, dgrad, wgrad
from miles.precision.fp8_gemm import FP8Operand, gemm_quantized, prepare_fp8_weight, quantize_input


class FP8WeightCache:
    """What the training forward and backward take from each master weight, made once per version of
    the weight from one quantization (128x128 blocks): the forward's FP8 operand (w8a8), its
    dequantized copy (the w8a16 forward, the bf16 backward), W^T's codes and scales (the FP8 backward).
    `clear()` frees them (the trainer does at the end of a train step and before offloading: they hold
    up to ~3 bytes per parameter on the device)."""

    def __init__(self, backend: str = "auto"):
        self.backend = backend  # precision.fp8_gemm: the engine's choice, so both sides run one kernel
        self._entries: dict[int, tuple[tuple, dict]] = {}

    def _product(self, w: torch.Tensor, name, make):
        # The version counter moves with every in-place update (optimizer steps, load_state_dict);
        # the storage address with every move (offload / onload).
        key = (w.data_ptr(), w._version, w.device)
        hit = self._entries.get(id(w))
        if hit is None or hit[0] != key:
            hit = self._entries[id(w)] = (key, {})
        if name not in hit[1]:
            with torch.no_grad():  # the codes are not kept: a second product quantizes again (cheap)
                hit[1][name] = make(*quantize_fp8_weight(w))
        return hit[1][name]

    def operand(self, w: torch.Tensor) -> FP8Operand:
        """The forward's FP8 operand, laid out for the engine's GEMM backend (w8a8)."""
        return self._product(w, "operand", lambda q, s: prepare_fp8_weight(q, s, self.backend))

    def dequantized(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """dequantize_fp8_weight(quantize_fp8_weight(w), dtype)."""
        return self._product(w, ("dequantized", dtype), lambda q, s: dequantize_fp8_weight(q, s, dtype))

    def transposed(self, w: torch.Tensor) -> TransposedFP8Weight:
        """W^T's codes and block scales: the FP8 backward's dgrad operand."""
        return self._product(w, "transposed", TransposedFP8Weight)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class _FP8Linear(torch.autograd.Function):
    """w8a8: the engine's FP8 GEMM forward; the backward in the compute dtype or in FP8."""

    @staticmethod
    def forward(ctx, x, w, bias, operand: FP8Operand, back):
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        xq, xs = quantize_input(x2, operand)
        y = gemm_quantized(xq, xs, x2.shape[0], operand, x.dtype, bias)
        # back: the dequantized weight (bf16 backward) or W^T's FP8 operand (FP8 backward)
        fp8_back = isinstance(back, TransposedFP8Weight)
        ctx.save_for_backward(xq, xs, *(() if fp8_back else (back,)))
        ctx.back = back if fp8_back else None
        ctx.m, ctx.k, ctx.w_dtype, ctx.dtype = x2.shape[0], k, w.dtype, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*lead, w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        xq, xs, *w_deq = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        x_deq = dequantize_fp8_act(xq[: ctx.m, : ctx.k], xs[: ctx.m], ctx.dtype) if ctx.needs_input_grad[1] else None
        grad_x, grad_w = _linear_grads(ctx, g, x_deq, w_deq[0] if w_deq else ctx.back)
        if grad_x is not None:
            grad_x = grad_x.reshape(*grad.shape[:-1], ctx.k)
        grad_b = g.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


class _W8A16Linear(torch.autograd.Function):
    """w8a16 under the FP8 backward: F.linear of the dequantized weight forward (what the engine's
    W8A16 GEMM multiplies, the bits of the plain path), dgrad and wgrad in FP8."""

    @staticmethod
    def forward(ctx, x, w, bias, w_deq: torch.Tensor, w_t: TransposedFP8Weight):
        ctx.save_for_backward(x)
        ctx.back, ctx.k, ctx.w_dtype, ctx.dtype = w_t, x.shape[-1], w.dtype, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, w_deq, bias)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        grad_x, grad_w = _linear_grads(ctx, g, x.reshape(-1, ctx.k), ctx.back)
        if grad_x is not None:
            grad_x = grad_x.reshape(*grad.shape[:-1], ctx.k)
        grad_b = g.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def _linear_grads(ctx, g: torch.Tensor, x2: torch.Tensor | None, back) -> tuple:
    """(grad_x [M, K], grad_W [N, K]) of y = x W^T for the inputs that need them. back: the dequantized
    weight (a bf16 backward: two GEMMs in the compute dtype) or W^T's FP8 operand (fp8_backward.py)."""
    fp8 = isinstance(back, TransposedFP8Weight)
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = dgrad(g, back, ctx.dtype) if fp8 else g @ back
    if ctx.needs_input_grad[1]:
        grad_w = (wgrad(g, x2, ctx.dtype) if fp8 else g.t() @ x2).to(ctx.w_dtype)
    return grad_x, grad_w


class _StraightThrough(torch.autograd.Function):
    """Forward: the cached dequantized weight (a view, no copy). Backward: its gradient to the master
    weight as it is (straight through the quantizer), in the master's dtype."""

    @staticmethod
    def forward(ctx, w, w_deq):
        ctx.w_dtype = w.dtype
        return w_deq.view_as(w_deq)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.w_dtype), None


def straight_through_dequantized(w: torch.Tensor, cache: FP8WeightCache, dtype: torch.dtype) -> torch.Tensor:
    """The w8a16 training weight: dequantize_fp8_weight(quantize_fp8_weight(w), dtype), made once per
    optimizer step, with gradients straight through to `w`. F.linear(x, it) in `dtype` is what the
    engine's W8A16 GEMM computes (the same weight values; fp32 sums in another order), and, unlike
    `fake_quant_fp8_weight`, no quantizer runs per forward."""
    return _StraightThrough.apply(w, cache.dequantized(w, dtype))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def fp8_train_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cache: FP8WeightCache,
                     fp8_backward: bool = False) -> torch.Tensor:
    """w8a8: x [..., K], w [N, K] (the master weight), bias [N] or None -> [..., N] in the compute dtype
    (autocast's when it is on, as F.linear would give, else x's); the backward in FP8 if asked."""
    dtype = _compute_dtype(x)
    back = cache.transposed(w) if fp8_backward else cache.dequantized(w, dtype)
    with torch.autocast(x.device.type, enabled=False):
        # The casts stay outside the Function, so autograd returns each gradient in its own dtype.
        return _FP8Linear.apply(x.to(dtype), w, None if bias is None else bias.to(dtype), cache.operand(w), back)


def w8a16_train_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                       cache: FP8WeightCache, dtype: torch.dtype | None = None) -> torch.Tensor:
    """w8a16 with the FP8 backward: F.linear(x, the dequantized weight, bias) in `dtype` (default: the
    compute dtype), the bits of `straight_through_dequantized`'s path (autocast's F.linear casts x and
    bias the same way)."""
    dtype = dtype or _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return _W8A16Linear.apply(x.to(dtype), w, None if bias is None else bias.to(dtype),
                                  cache.dequantized(w, dtype), cache.transposed(w))
