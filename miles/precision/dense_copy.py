"""A weight-only engine layer's dequantized copy, for calls of many rows (`rollout.dense_weight_copies`).

    dense = dequantized(q, scale, quant, group, k, dtype)   # once per sync (QuantLinear.refresh)
    y = F.linear(x, dense, bias) if applies(x, dense) else <the weight-only kernels>

At 512 rows (a GRPO rollout of 64 prompts x 8 samples decodes them at once) a Qwen3-4B layer's GEMM is
compute-bound: the fused weight-only kernels ran at 0.56-0.63x cuBLAS bf16, and the one-pass
dequantization + cuBLAS pays the dequantization in every call (docs/benchmarks.md). A copy
dequantized once per sync makes those calls cuBLAS bf16 GEMMs, at the price of the weight's bf16
bytes beside the payload (the memory plan counts them). The copy is the one-pass dequantization's
(the same bits as `dequantize_fp8_weight` / `dequantize_int4`), so for FP8 `F.linear(x, copy)` is bit
for bit the product FP8 computes above 256 rows anyway. INT4's fused kernel takes up to 1024 rows:
from 257 to 1024 rows the copies sum in cuBLAS's order instead (the order of the trainer's QAT forward).
Small calls (decode rows <= 256) keep the weight-only kernels, which read half / a quarter of the bytes.

`auto` (None, the default): on for a CUDA engine of a weight-only quantized rollout (FP8 w8a16, INT4)
whose rollout batch (batch_size x n_samples_per_prompt) exceeds MIN_ROWS - 1 rows; a run resolves it
with its memory plan (miles/hardware/planner.py `resolve_memory_choices`: off where the copies would
not fit). On an H100 the 4B fp8 GRPO rollout of 512 rows took 4.04 s with them against bf16's 4.08 s
side by side, and 6.57 s without them in an earlier session (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from miles.precision import dequant_triton
from miles.precision.fp8 import dequantize_fp8_weight
from miles.precision.int4 import dequantize_int4

MIN_ROWS = 257  # the FP8 fused kernel's last row count is 256 (fp8_w8a16_triton.FUSED_MAX_ROWS)


def dequantized(q: torch.Tensor, scale: torch.Tensor, quant: str, group: int, k: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight in `dtype`: in one Triton pass on CUDA, else the torch functions (same bits)."""
    fmt = "int4" if quant == "int4" else "fp8"
    one_pass = dequant_triton.one_pass_weight_or_none(q, scale, fmt, dtype, group, k=k)
    if one_pass is not None:
        return one_pass
    if fmt == "int4":
        return dequantize_int4(q, scale, group, k=k, dtype=dtype)
    return dequantize_fp8_weight(q, scale, dtype)


def applies(x: torch.Tensor, dense: torch.Tensor) -> bool:
    """Whether a call of x's rows goes through the dense copy (held, and enough rows)."""
    return dense.numel() > 0 and x.numel() // max(x.shape[-1], 1) >= MIN_ROWS


def weight_only(rollout_quant: str, fp8_scheme: str) -> bool:
    """Whether the rollout format has weight-only layers, the ones that can hold a copy (FP8 w8a16, INT4)."""
    return rollout_quant == "int4" or (rollout_quant == "fp8" and fp8_scheme == "w8a16")


def wanted(setting: bool | None, device: str, rollout_quant: str, fp8_scheme: str, rows: int) -> bool:
    """rollout.dense_weight_copies resolved: an explicit true / false, or auto (None)."""
    if not weight_only(rollout_quant, fp8_scheme):
        return False
    if setting is not None:
        return setting
    return device.startswith("cuda") and rows >= MIN_ROWS
