"""Fused FP8 W8A16 GEMM (Triton): e4m3 weights with 128x128 block scales times bf16 activations.

    y = w8a16_linear_auto(x, q_w, w_scale, bias)   # x [..., K] bf16, q_w [N, K] e4m3, w_scale [N/128, K/128]

The weight-only FP8 scheme (`precision.fp8_scheme=w8a16`): the engine holds the FP8 payload (half of
bf16's bytes), the activations stay in bf16. Each program loads a tile of FP8 codes, multiplies them by
their block scale in fp32 and rounds once to x.dtype, which are the bits `dequantize_fp8_weight(q, s,
x.dtype)` gives, then feeds the tile to `tl.dot` (fp32 accumulator). The bf16 weight never exists in
memory: a memory-bound decode GEMM reads half of bf16's weight bytes.

Why the scheme exists: with 1x128 FP8 activations (w8a8) every small bf16 difference between the
engine's and the trainer's activations can flip a 3-mantissa-bit rounding, so the train / rollout
log-prob mismatch grows to several times bf16's (docs/precision.md). Without activation quantization
the trainer's forward, `F.linear(x, dequantize_fp8_weight(...))`, multiplies the same weight values,
and the two sides differ only by the fp32 summation order, as in the bf16 recipe.

Numerics against `F.linear(x, dequantize_fp8_weight(q, s, x.dtype), bias)`: every weight element is
the same x.dtype value; products are exact in fp32 and summed in fp32 over K tiles in one pass
(with SPLIT_K: per slice, then the partials in slice order 0..S-1, a reordered sum).
The bias is added to the fp32 sum and the result rounded once (cuBLAS's addmm epilogue). Run-to-run
deterministic (no atomics), no host syncs: capturable in a CUDA graph. Tiles from
`pick_w8a16_config` (its own at 17-256 rows, int4_triton's elsewhere), always in one K slice:

Why no split-K: each output then sums K in one pass, as cuBLAS does for the prefill and the
trainer's forward, and the engine's decode log-probs equal those of dequantize + cuBLAS in every
printed digit (an H100, Qwen3-0.6B shape, `benchmarks/mismatch_sources.py --w8a16-kernel`: decode -
prefill 5.975e-3 for both, 7.227e-3 split, against bf16's 6.023e-3; the split partials, summed
afterwards, round to other bf16 outputs). `SPLIT_K = True` restores the split (int4_triton's
`split_k` and `_splitk_reduce_kernel`) for timing it.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
import torch.nn.functional as F

from miles.precision.dequant_triton import one_pass_linear_or_none
from miles.precision.fp8 import BLOCK, FP8_DTYPE, dequantize_fp8_weight
from miles.precision.int4 import _ceil_div
from miles.precision.int4_triton import (FUSED_DTYPES, TileConfig, _interpreting, _sm_count, pick_config, split_k,
                                         triton, triton_available)

if triton is not None:
    import triton.language as tl

    from miles.precision.int4_triton import _dot_tile, _round, _splitk_reduce_kernel, _store_tile

    @triton.jit
    def _e4m3_to_fp32(raw, INTERPRET: tl.constexpr):
        # uint8 codes -> their fp32 values. Compiled: the hardware conversion. The interpreter has no
        # fp8 type, so there the bits are decoded by hand (sign, 4 exponent bits with bias 7, 3 mantissa
        # bits; exponent 0 is subnormal, m * 2^-9); the quantizer never writes the NaN code.
        if INTERPRET:
            b = raw.to(tl.int32)
            e = (b >> 3) & 15
            mant = b & 7
            sign = b >> 7
            normal = ((sign << 31) | ((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
            sub = mant.to(tl.float32) * 0.001953125
            sub = tl.where(sign == 1, -sub, sub)
            return tl.where(e == 0, sub, normal)
        else:
            return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)

    @triton.jit
    def _w8a16_kernel(x_ptr, q_ptr, s_ptr, b_ptr, out_ptr,
                      M, N, K, KB, k_chunk,
                      stride_xm, stride_qn, stride_sn, stride_os, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SCALE_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
                      SWAP: tl.constexpr, SCALAR_SCALE: tl.constexpr):
        # One program: rows [pid_m * BM, +BM) x cols [pid_n * BN, +BN) over K slice pid_k. With split-K
        # out_ptr is the fp32 partial buffer [S, M, N] (stride_os per slice), else the output itself.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        row_block = offs_n // SCALE_BLOCK
        # Scale blocks per K tile (BK >= 128) or one block covering the tile (BK < 128; both powers of
        # two and k0 a multiple of BK, so a tile never straddles two blocks).
        NB: tl.constexpr = BLOCK_K // SCALE_BLOCK if BLOCK_K >= SCALE_BLOCK else 1
        BS: tl.constexpr = BLOCK_K // NB
        k_lo = pid_k * k_chunk
        k_hi = tl.where(k_lo + k_chunk < K, k_lo + k_chunk, K)  # tl.where: see int4_triton's kernel
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            raw = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                          other=0)
            q = _e4m3_to_fp32(raw, INTERPRET)
            if SCALAR_SCALE:  # the tile lies in one 128 x 128 block: one scale, no reshapes
                w = q * tl.load(s_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK)
            else:
                offs_b = k0 // SCALE_BLOCK + tl.arange(0, NB)
                s = tl.load(s_ptr + row_block[:, None] * stride_sn + offs_b[None, :],
                            mask=n_ok[:, None] & (offs_b[None, :] < KB), other=0.0)
                w = tl.reshape(tl.reshape(q, (BLOCK_N, NB, BS)) * s[:, :, None], (BLOCK_N, BLOCK_K))
            # fp32 product rounded to x.dtype once: dequantize_fp8_weight's bits, element for element.
            w = _round(w, x.dtype, INTERPRET)
            acc = _dot_tile(w, x, acc, SWAP, INTERPRET)
        _store_tile(acc, b_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, pid_k * stride_os, stride_om, HAS_BIAS,
                    SWAP, INTERPRET)


SPLIT_K = False  # see the module docstring: the split changes the summation order away from cuBLAS's


def pick_w8a16_config(m: int, n: int, k: int, sms: int = 132) -> TileConfig:
    """Tiles in one K slice, from `kernel_sweep.py w8a16 --decode` on an H100 (2026-12-06, the 4B
    layers, graph-timed against cuBLAS bf16). Output tiles >= 64 wide kept the prefill GEMM's bits in
    every run; narrower ones lost them in 120 of 128, so more programs cannot come from narrower
    tiles; where 64-wide tiles leave SMs idle, deeper K tiles and wider ones did better:
    - <= 16 and > 256 rows: int4_triton's tiles;
    - 17-64 rows: 64-wide tiles (one block scale across), 256 deep where they leave SMs idle (qkv,
      o_proj, down_proj 0.59x / 0.37x / 0.49x bf16 against 0.45x / 0.28x / 0.35x at 128 deep), else
      128 deep (gate_up 1.11x against 0.93x); 32 rows a tile where 64-row tiles leave over half the
      SMs idle (the 2560-wide layers at 64 rows: o_proj / down_proj 0.55x / 0.73x against 0.37x /
      0.49x, second sweep 2026-12-06, still the prefill's bits);
    - 65-256 rows where int4_triton's 128 x 64 tiles leave SMs idle: 64 x 128 x 256, 8 warps, 4
      stages (the 2560-wide layers 0.38x / 0.40x against 0.28x / 0.31x).
    SPLIT_K: the split-K tiles timed before (int4_triton's, 128 deep at 17-64 rows)."""
    if SPLIT_K:
        if not 16 < m <= 64:
            return pick_config(m, n, k, sms)
        bm = 32 if m <= 32 else 64
        return TileConfig(bm, 64, BLOCK, split_k(m, n, k, bm, 64, BLOCK, sms), 4, 3)
    if 16 < m <= 64:
        bm = 32 if m <= 32 or _ceil_div(n, 64) < sms // 2 else 64
        idle = _ceil_div(m, bm) * _ceil_div(n, 64) < sms
        return TileConfig(bm, 64, 2 * BLOCK if idle else BLOCK, 1, 4, 3)
    if 64 < m <= 256 and _ceil_div(m, 128) * _ceil_div(n, 64) < sms:
        return TileConfig(64, 128, 2 * BLOCK, 1, 8, 4)
    return replace(pick_config(m, n, k, sms), split_k=1)


def fused_supported(x: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> str | None:
    """None when w8a16_linear_fused handles these operands, else the reason it does not."""
    if triton is None:
        return "triton is not importable"
    if x.dtype not in FUSED_DTYPES:
        return f"activations are {x.dtype}, the kernel takes {FUSED_DTYPES}"
    if q_w.dim() != 2 or q_w.dtype != FP8_DTYPE or w_scale.dtype != torch.float32:
        return "weight must be one 2-D float8_e4m3fn tensor with fp32 block scales"
    n, k = q_w.shape
    if k == 0 or n == 0 or x.numel() == 0:
        return "empty operand"
    if x.shape[-1] != k or tuple(w_scale.shape) != (_ceil_div(n, BLOCK), _ceil_div(k, BLOCK)):
        return f"weight {tuple(q_w.shape)} / scales {tuple(w_scale.shape)} do not fit K={x.shape[-1]}"
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        return "bias must be [N] in x.dtype"
    if len({t.device for t in (x, q_w, w_scale) + (() if bias is None else (bias,))}) != 1:
        return "operands on different devices"
    return None


def w8a16_linear_fused(x: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                       *, config: TileConfig | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16) @ dequantize_fp8_weight(q_w [N, K], w_scale).T (+ bias) -> [..., N] in x.dtype.

    `config` overrides the tile heuristic (tests, tuning; `unpack` is ignored). Raises ValueError on
    operands it does not take: w8a16_linear_auto falls back instead.
    """
    reason = fused_supported(x, q_w, w_scale, bias)
    if reason is not None:
        raise ValueError(f"w8a16_linear_fused: {reason}")
    *lead, k = x.shape
    n = q_w.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    raw = (q_w if q_w.stride(-1) == 1 else q_w.contiguous()).view(torch.uint8)
    scales = w_scale if w_scale.stride(-1) == 1 else w_scale.contiguous()
    m = x2.shape[0]
    dev_index = x.device.index if x.device.type == "cuda" else None
    cfg = config or pick_w8a16_config(m, n, k, _sm_count(dev_index))
    k_chunk = _ceil_div(_ceil_div(k, cfg.block_k), cfg.split_k) * cfg.block_k
    split = _ceil_div(k, k_chunk)  # no empty slices
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    dst = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (_ceil_div(m, cfg.block_m), _ceil_div(n, cfg.block_n), split)
    b_arg = bias if bias is not None else scales  # never read when HAS_BIAS is False
    _w8a16_kernel[grid](
        x2, raw, scales, b_arg, dst,
        m, n, k, scales.shape[1], k_chunk,
        x2.stride(0), raw.stride(0), scales.stride(0), m * n, n,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SCALE_BLOCK=BLOCK,
        HAS_BIAS=bias is not None and split == 1, INTERPRET=_interpreting(), SWAP=cfg.swap,
        SCALAR_SCALE=cfg.block_k == BLOCK and BLOCK % cfg.block_n == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(_ceil_div(m * n, block),)](
            dst, b_arg, out, m * n, n, split, HAS_BIAS=bias is not None, BLOCK=block,
            INTERPRET=_interpreting(), num_warps=4)
    return out.reshape(*lead, n)


def w8a16_linear(x: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference and the fallback: F.linear(x, dequantize_fp8_weight(q_w, w_scale, x.dtype), bias),
    what the trainer's w8a16 forward computes (any device, any row count)."""
    return F.linear(x, dequantize_fp8_weight(q_w, w_scale, x.dtype), bias)


# Rows above which w8a16_linear_auto dequantizes (in one pass, dequant_triton.py) and calls cuBLAS.
# benchmarks/weight_only_ws.py on an H100, the 4B layers, graph-timed against bf16 F.linear
# (2026-12-06): one-pass dequantize + cuBLAS 0.56-0.64x at 512 rows and 0.71-0.74x at 1024 against the
# fused kernel's 0.32-0.53x and 0.39-0.50x, with 0 outputs off the 4096-row GEMM's bits (the trainer's);
# at 256 rows it wins on 3 of the 4 layers (0.43-0.56x against 0.36-0.54x) but leaves 2,785 of the
# down projection's outputs off, so 256 rows stay fused.
FUSED_MAX_ROWS = 256
_REFUSED: set[tuple[int, int, int]] = set()  # (rows, N, K) whose launch the GPU refused


def w8a16_linear_auto(x: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel on CUDA where it applies (M <= FUSED_MAX_ROWS), else w8a16_linear's product
    (on CUDA its weight dequantized in one pass: dequant_triton.py, the same bits).

    The two differ only in fp32 summation order. A launch the GPU refuses for its resources falls
    back to w8a16_linear with one warning, as int4_linear_auto does.
    """
    rows = x.numel() // max(x.shape[-1], 1)
    key = (rows, q_w.shape[0], x.shape[-1])
    if x.is_cuda and rows <= FUSED_MAX_ROWS and key not in _REFUSED and fused_supported(x, q_w, w_scale, bias) is None:
        try:
            return w8a16_linear_fused(x, q_w, w_scale, bias)
        except triton.runtime.errors.OutOfResources as e:
            _REFUSED.add(key)
            warnings.warn(f"w8a16_linear_fused refused on this GPU for {key} ({e}); using w8a16_linear", stacklevel=2)
    out = one_pass_linear_or_none(x, q_w, w_scale, "fp8", bias)
    return out if out is not None else w8a16_linear(x, q_w, w_scale, bias)
