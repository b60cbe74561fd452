"""The training side of an FP8 nn.Linear: the engine's FP8 GEMM forward, a bf16 backward.

    cache = FP8WeightCache()
    y = fp8_train_linear(x, linear.weight, linear.bias, cache)   # x [..., K] -> [..., N]   (fp8_scheme w8a8)
    w = straight_through_dequantized(linear.weight, cache, torch.bfloat16)  # F.linear(x, w)   (w8a16)

Forward: the master weight is quantized (128x128 blocks, `quantize_fp8_weight`) once per optimizer
step (the cache keys on the parameter's storage and version), the input in 1x128 tiles, and the
product is the engine's own `gemm_quantized` on the backend the engine resolves (`torch._scaled_mm`
on Hopper, DeepGEMM where it loads, the emulated GEMM on the CPU). So a layer gives the engine's
bits for the same input, instead of a bf16 GEMM of dequantized operands that rounds differently
(the cause of the fp8 recipe's train / rollout mismatch on the GPU, docs/precision.md).

Backward, in the compute dtype (bf16 under autocast), straight through the quantizers:
grad_x = grad_y @ dequant(W), grad_W = grad_y^T @ dequant(x) (the dequantized 1x128 activations the
forward multiplied, saved as fp8 codes + scales: half the bytes of bf16 activations). Master
weights and the optimizer are unchanged. Per-tensor FP8 backward (DeepSeek-V3's 1x128 / 128x1
gradient tiles) is not done: the backward GEMMs keep bf16's accuracy.
"""

from __future__ import annotations

import torch

from miles.precision.fp8 import dequantize_fp8_act, dequantize_fp8_weight, quantize_fp8_weight
from miles.precision.fp8_gemm import FP8Operand, gemm_quantized, prepare_fp8_weight, quantize_input


class FP8WeightCache:
    """Each master weight's FP8 operand and its dequantized copy (for the backward), or (w8a16) the
    dequantized copy alone, made once per version of the weight. `clear()` frees them (the trainer
    does at the end of a train step and before offloading: the copies hold up to ~3 bytes per
    parameter on the device)."""

    def __init__(self, backend: str = "auto"):
        self.backend = backend  # precision.fp8_gemm: the engine's choice, so both sides run one kernel
        self._entries: dict[int, tuple[tuple, FP8Operand, torch.Tensor]] = {}

    def get(self, w: torch.Tensor, dtype: torch.dtype) -> tuple[FP8Operand, torch.Tensor]:
        # The version counter moves with every in-place update (optimizer steps, load_state_dict);
        # the storage address with every move (offload / onload).
        key = (w.data_ptr(), w._version, w.device, dtype)
        hit = self._entries.get(id(w))
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        with torch.no_grad():
            q, s = quantize_fp8_weight(w)
            entry = (key, prepare_fp8_weight(q, s, self.backend), dequantize_fp8_weight(q, s, dtype))
        self._entries[id(w)] = entry
        return entry[1], entry[2]

    def dequantized(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """dequantize_fp8_weight(quantize_fp8_weight(w), dtype), once per version of w."""
        key = (w.data_ptr(), w._version, w.device, dtype, "dequantized")
        hit = self._entries.get(id(w))
        if hit is not None and hit[0] == key:
            return hit[2]
        with torch.no_grad():
            entry = (key, None, dequantize_fp8_weight(*quantize_fp8_weight(w), dtype))
        self._entries[id(w)] = entry
        return entry[2]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, operand: FP8Operand, w_deq: torch.Tensor):
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        xq, xs = quantize_input(x2, operand)
        y = gemm_quantized(xq, xs, x2.shape[0], operand, x.dtype, bias)
        ctx.save_for_backward(xq, xs, w_deq)
        ctx.m, ctx.k, ctx.w_dtype = x2.shape[0], k, w.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*lead, w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        xq, xs, w_deq = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(w_deq.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ w_deq).reshape(*grad.shape[:-1], ctx.k)
        if ctx.needs_input_grad[1]:
            x_deq = dequantize_fp8_act(xq[: ctx.m, : ctx.k], xs[: ctx.m], w_deq.dtype)
            grad_w = (g.t() @ x_deq).to(ctx.w_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


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


def fp8_train_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cache: FP8WeightCache) -> torch.Tensor:
    """x [..., K], w [N, K] (the master weight), bias [N] or None -> [..., N] in the compute dtype
    (autocast's when it is on, as F.linear would give, else x's)."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    operand, w_deq = cache.get(w, dtype)
    with torch.autocast(device, enabled=False):
        # The casts stay outside the Function, so autograd returns each gradient in its own dtype.
        return _FP8Linear.apply(x.to(dtype), w, None if bias is None else bias.to(dtype), operand, w_deq)
