"""Fused INT4 W4A16 GEMM (Triton): reads the packed nibbles and fp32 group scales of int4.py directly.

`int4_linear` dequantizes the whole weight to x.dtype in torch ops and then runs a bf16 GEMM, so it
moves the weight three times (int4 in, bf16 out, bf16 in again). This kernel unpacks a tile of
nibbles in registers, multiplies by the group scale in fp32 and rounds to x.dtype once (the exact
bits `dequantize_int4(..., dtype=x.dtype)` produces), and feeds that tile straight to `tl.dot`
(fp32 accumulator). The bf16 weight never exists in memory, so a memory-bound decode GEMM reads
~4x fewer weight bytes than bf16.

Numerics, against `int4_linear` (= F.linear(x, dequantize_int4(...), bias)):
- every weight element entering the dot is the same x.dtype value as in int4_linear;
- products are exact in fp32 and accumulated in fp32, as cuBLAS does, but in a different order
  (K tiles of BLOCK_K, and split-K partials summed in a fixed order): the outputs differ from
  int4_linear by the rounding of a reordered fp32 sum, i.e. what two bf16 GEMM libraries differ by
  (~1e-3 relative, norm-wise), and both are equally far from an fp32 reference;
- the bias is added to the fp32 sum and the result rounded to x.dtype once, which is what cuBLAS's
  bias epilogue (addmm with beta=1) computes; a bias added after rounding would round twice.
Run-to-run deterministic: no atomics; split-K partials go to an fp32 [S, M, N] buffer that a second
kernel sums in split order 0..S-1. No host syncs and fixed-shape allocations through the caching
allocator only, so the call can be captured in a CUDA graph.

Layout ("swap AB"): the kernel computes out^T tiles, acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T, so
the dequantized weight (made in registers) is the left MMA operand, which Hopper's wgmma may take from
registers, and the activations are the right one, read from shared memory; a 1-row decode then uses a
16-wide MMA N dimension instead of padding M to 64. TileConfig.swap / .unpack select alternatives.
Grid (M tiles, N tiles, split-K slices); block sizes and split from `pick_config` (by M).

Speed: `benchmarks/precision_gemm.py` (its CUDA-graph columns) and `benchmarks/precision_decode.py`
(docs/benchmarks.md). Eager calls pay Triton's Python launch: use it inside CUDA graphs.

`int4_linear_auto` is what callers use: this kernel where it applies (CUDA, triton importable,
bf16/fp16 activations, one 2-D weight, M <= FUSED_MAX_ROWS = 1024: decode and short prefill),
`int4_linear` otherwise.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, replace

import torch

from miles.precision.dequant_triton import one_pass_linear_or_none
from miles.precision.int4 import GROUP_SIZES, _ceil_div, int4_linear

try:  # triton ships with CUDA torch wheels; a CPU machine may lack it (int4_linear_auto falls back)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

FUSED_DTYPES = (torch.bfloat16, torch.float16)


def triton_available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration; `split_k` = number of K slices whose partials are reduced afterwards."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    # 0: load each byte once, tl.join(lo, hi) + reshape to interleave (measured on the H200);
    # 1: load each byte for both its elements and shift by 4 * (k odd), scales by k // group (no
    #    shuffles; interpreter-tested, not yet timed on the GPU).
    unpack: int = 0
    # True: acc = W_tile @ x_tile^T (weight = left MMA operand, may stay in registers for wgmma);
    # False: acc = x_tile @ W_tile^T. Only True has been timed on the GPU.
    swap: bool = True


if triton is not None:

    @triton.jit
    def _round(v, dtype: tl.constexpr, INTERPRET: tl.constexpr):
        # fp32 -> dtype, round to nearest even (what torch's .to() does). The interpreter truncates
        # fp32 -> bf16, so there it is done by hand (finite v only, which q * scale and sums of them
        # are); fp16 goes through numpy's astype, already round-to-nearest-even.
        if dtype == tl.float32:
            return v
        elif INTERPRET and dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return v.to(dtype, fp_downcast_rounding="rtne")

    @triton.jit
    def _dot_tile(w, x, acc, SWAP: tl.constexpr, INTERPRET: tl.constexpr):
        # acc += W_tile @ x_tile^T (SWAP: acc is [BN, BM]) or x_tile @ W_tile^T. Under the interpreter
        # (see _interpreting()) the same exact bf16 products go through an fp32 IEEE dot.
        if INTERPRET:
            if SWAP:
                return tl.dot(w.to(tl.float32), tl.trans(x).to(tl.float32), acc, input_precision="ieee")
            else:
                return tl.dot(x.to(tl.float32), tl.trans(w).to(tl.float32), acc, input_precision="ieee")
        else:
            if SWAP:
                return tl.dot(w, tl.trans(x), acc)
            else:
                return tl.dot(x, tl.trans(w), acc)

    @triton.jit
    def _store_tile(acc, b_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, slice_offset, stride_om,
                    HAS_BIAS: tl.constexpr, SWAP: tl.constexpr, INTERPRET: tl.constexpr):
        # The tile (+ bias, only on the unsplit path: split-K adds it in the reduction), rounded once.
        if SWAP:
            out_mask = n_ok[:, None] & m_ok[None, :]
            out_offs = slice_offset + offs_m[None, :] * stride_om + offs_n[:, None]
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        else:
            out_mask = m_ok[:, None] & n_ok[None, :]
            out_offs = slice_offset + offs_m[:, None] * stride_om + offs_n[None, :]
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, _round(acc, out_ptr.dtype.element_ty, INTERPRET), mask=out_mask)

    @triton.jit
    def _w4a16_kernel(x_ptr, p_ptr, s_ptr, b_ptr, out_ptr,
                      M, N, K, KP, KG, k_chunk,
                      stride_xm, stride_pn, stride_sn, stride_os, stride_om,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
                      UNPACK: tl.constexpr, SWAP: tl.constexpr):
        # One program: rows [pid_m * BM, +BM) x cols [pid_n * BN, +BN) over K slice pid_k. With split-K
        # out_ptr is the fp32 partial buffer [S, M, N] (stride_os per slice), else the output itself.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        # Groups per tile (BK >= GROUP) or one group covering the tile (BK < GROUP; both are powers of
        # two, so a tile never straddles two groups).
        NG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1
        GS: tl.constexpr = BLOCK_K // NG
        k_lo = pid_k * k_chunk
        # tl.where, not tl.minimum: the latter is a @triton.jit helper that the CPU interpreter cannot
        # call when triton was imported before TRITON_INTERPRET was set (the unit tests' situation).
        k_hi = tl.where(k_lo + k_chunk < K, k_lo + k_chunk, K)
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)
            if UNPACK == 0:
                offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                # Out-of-range bytes read as 0x88 (two zero codes); their x columns are 0 anyway.
                p = tl.load(p_ptr + offs_n[:, None] * stride_pn + offs_b[None, :],
                            mask=n_ok[:, None] & (offs_b[None, :] < KP), other=0x88)
                # Even element in the low nibble: join puts (lo, hi) side by side, reshape interleaves.
                codes = tl.reshape(tl.join(p & 0x0F, p >> 4), (BLOCK_N, BLOCK_K))
                # code - 8 without an int-to-float conversion (quarter rate on Hopper): 0x4B000000 | code
                # is the fp32 2^23 + code, exactly.
                q = (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                offs_g = k0 // GROUP + tl.arange(0, NG)
                s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
                            mask=n_ok[:, None] & (offs_g[None, :] < KG), other=0.0)
                w = tl.reshape(tl.reshape(q, (BLOCK_N, NG, GS)) * s[:, :, None], (BLOCK_N, BLOCK_K))
            else:
                # Every byte is read for both of its elements (the second read hits L1) and shifted by
                # 4 * (k odd): no shuffles, the tile keeps one register layout from load to dot.
                w_ok = n_ok[:, None] & (offs_k[None, :] < K)
                p = tl.load(p_ptr + offs_n[:, None] * stride_pn + (offs_k // 2)[None, :], mask=w_ok, other=0x88)
                q = (((p >> ((offs_k % 2) * 4).to(tl.uint8)[None, :]) & 0x0F).to(tl.int32) - 8).to(tl.float32)
                if BLOCK_K <= GROUP:
                    s = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP, mask=n_ok, other=0.0)
                    w = q * s[:, None]
                else:
                    s = tl.load(s_ptr + offs_n[:, None] * stride_sn + (offs_k // GROUP)[None, :], mask=w_ok, other=0.0)
                    w = q * s
            # fp32 product rounded to x.dtype once: dequantize_int4's bits, element for element.
            w = _round(w, x.dtype, INTERPRET)
            acc = _dot_tile(w, x, acc, SWAP, INTERPRET)
        _store_tile(acc, b_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, pid_k * stride_os, stride_om, HAS_BIAS,
                    SWAP, INTERPRET)

    @triton.jit
    def _splitk_reduce_kernel(ws_ptr, b_ptr, out_ptr, MN, N, S, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                              INTERPRET: tl.constexpr):
        # Sum the S fp32 partials in slice order 0..S-1 (fixed: deterministic), add bias, round once.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(S):
            acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, _round(acc, out_ptr.dtype.element_ty, INTERPRET), mask=ok)


# Triton 3.9's CPU interpreter (TRITON_INTERPRET=1, the CPU tests) multiplies the raw uint16 bits of
# bf16 dot operands and truncates fp32 -> bf16. There the kernel rounds by hand and feeds the
# bf16-valued tiles to an fp32 IEEE dot: bf16 x bf16 products are exact in fp32, so these are the values
# the GPU's bf16 MMA multiplies; only the compiled GPU path runs the real bf16 dot. Read once at import,
# when @triton.jit chose between compiling and interpreting.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreting() -> bool:
    return _INTERPRET


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 132  # the interpreter on CPU: an H200's count keeps the heuristic exercised
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Split-K where the output tiles leave SMs idle. The W8A16 kernel stopped splitting on 2026-12-06:
# split partials, summed afterwards, round to other bf16 outputs than cuBLAS's one pass over K, which
# the prefill and the trainer run, and that raised its train / rollout mismatch 1.16x
# (fp8_w8a16_triton.py). Here it does the same (an H100, Qwen3-0.6B shape, `mismatch_sources.py
# --w4a16-kernel`): int4_qat 7.41e-3 split against 6.39e-3 in one K slice (bf16 6.22e-3). One slice
# costs decode speed on the 4B shape, 0.83x -> 0.56x bf16 at 64 rows (docs/benchmarks.md), so the
# split stays the default until one-slice tiles win that back (`kernel_sweep.py w4a16 --decode`);
# False gives one K slice.
SPLIT_K = True


@functools.lru_cache(maxsize=4096)
def pick_config(m: int, n: int, k: int, sms: int = 132) -> TileConfig:
    """Block sizes by M; split-K so that small-M launches still put ~2 programs on every SM.

    From sweeps on one H200 (Qwen3-0.6B/4B shapes, group 128): decode (M <= 64, CUDA-graph timings)
    is weight-bandwidth bound and liked BN 64 x BK 256 tiles with split-K up to ~2 programs per SM
    (one K tile per slice is fine), 3 stages at M <= 16 (`kernel_sweep.py w4a16 --decode` / `w8a16
    --decode`, 2026-12-04: faster than 4 on every 4B layer in both formats, 1.44x on the 19456-wide
    gate_up of W8A16); 128-1024 rows (`benchmarks/kernel_sweep.py int4`, eager) liked
    128 x 64 output tiles, BK 64, 4 warps: within 10% of the best of 10 configs on every 4B layer.
    At 17-64 rows where the output tiles alone fill the SMs (no split), BK 128 with 3 stages (an
    H100's `kernel_sweep.py w4a16 --decode`, 2026-12-06: the 19456-wide gate_up at 64 rows 1.05x
    bf16 against 0.88x at BK 256, 2 stages).
    """
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bn, bk, warps, stages = 64, 256, 4, (3 if m <= 16 else 2)
        if m > 16 and split_k(m, n, k, bm, bn, bk, sms) == 1:
            bk, stages = 128, 3
    else:
        bm, bn, bk, warps, stages = 128, 64, 64, 4, 3
    return TileConfig(bm, bn, bk, split_k(m, n, k, bm, bn, bk, sms), warps, stages)


def split_k(m: int, n: int, k: int, bm: int, bn: int, bk: int, sms: int = 132) -> int:
    """K slices that put ~2 programs on every SM when the output tiles alone do not, capped at the
    K tiles (no empty slices) and at 32 (the partial buffer grows with the split)."""
    tiles = _ceil_div(m, bm) * _ceil_div(n, bn)
    return 1 if tiles >= sms else max(1, min(_ceil_div(2 * sms, tiles), _ceil_div(k, bk), 32))


def fused_supported(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int,
                    bias: torch.Tensor | None = None) -> str | None:
    """None when int4_linear_fused handles these operands, else the reason it does not."""
    if triton is None:
        return "triton is not importable"
    if x.dtype not in FUSED_DTYPES:
        return f"activations are {x.dtype}, the kernel takes {FUSED_DTYPES}"
    if group not in GROUP_SIZES:
        return f"group {group} not in {GROUP_SIZES}"
    if packed.dim() != 2 or packed.dtype != torch.uint8 or scales.dtype != torch.float32:
        return "weight must be one 2-D uint8 packed tensor with fp32 scales"
    k = x.shape[-1]
    n = packed.shape[0]
    if k == 0 or x.numel() == 0 or n == 0:
        return "empty operand"
    if packed.shape[1] != _ceil_div(k, 2) or tuple(scales.shape) != (n, _ceil_div(k, group)):
        return f"packed {tuple(packed.shape)} / scales {tuple(scales.shape)} do not fit K={k}, N={n}"
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        return "bias must be [N] in x.dtype"
    if len({t.device for t in (x, packed, scales) + (() if bias is None else (bias,))}) != 1:
        return "operands on different devices"
    return None


def int4_linear_fused(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int = 128,
                      bias: torch.Tensor | None = None, *, config: TileConfig | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16) @ dequant(packed [N, ceil(K/2)], scales [N, ceil(K/group)]).T (+ bias).

    Same value per weight element as int4_linear; only the fp32 accumulation order differs (module
    doc). `config` overrides the heuristic (tests, tuning). Raises ValueError on unsupported operands:
    use int4_linear_auto to fall back instead.
    """
    reason = fused_supported(x, packed, scales, group, bias)
    if reason is not None:
        raise ValueError(f"int4_linear_fused: {reason}")
    *lead, k = x.shape
    n = packed.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    packed = packed if packed.stride(-1) == 1 else packed.contiguous()
    scales = scales if scales.stride(-1) == 1 else scales.contiguous()
    m = x2.shape[0]
    dev_index = x.device.index if x.device.type == "cuda" else None
    cfg = config or pick_config(m, n, k, _sm_count(dev_index))
    if config is None and not SPLIT_K:
        cfg = replace(cfg, split_k=1)
    k_chunk = _ceil_div(_ceil_div(k, cfg.block_k), cfg.split_k) * cfg.block_k
    split = _ceil_div(k, k_chunk)  # no empty slices
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    dst = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (_ceil_div(m, cfg.block_m), _ceil_div(n, cfg.block_n), split)
    b_arg = bias if bias is not None else scales  # never read when HAS_BIAS is False
    _w4a16_kernel[grid](
        x2, packed, scales, b_arg, dst,
        m, n, k, packed.shape[1], scales.shape[1], k_chunk,
        x2.stride(0), packed.stride(0), scales.stride(0), m * n, n,
        GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        HAS_BIAS=bias is not None and split == 1, INTERPRET=_interpreting(), UNPACK=cfg.unpack, SWAP=cfg.swap,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(_ceil_div(m * n, block),)](
            dst, b_arg, out, m * n, n, split, HAS_BIAS=bias is not None, BLOCK=block,
            INTERPRET=_interpreting(), num_warps=4)
    return out.reshape(*lead, n)


# Rows above which int4_linear_auto dequantizes (in one pass, dequant_triton.py) and calls cuBLAS.
# `kernel_sweep.py int4` on the 4B layers (sum of the 4 GEMMs, eager): fused 0.43 / 0.69 / 1.06 ms at
# 128 / 512 / 1024 rows against int4_linear's 1.14 / 1.21 / 1.40 ms; at 4096 rows dequantize + cuBLAS
# wins. benchmarks/weight_only_ws.py (an H100, 2026-12-06, against bf16 F.linear): the one-pass
# dequantization + cuBLAS 0.13-0.37x at 256-1024 rows (fused 0.24-0.53x), 0.54-0.67x at 4096 (eager
# dequantization 0.52-0.56x, fused 0.33-0.42x).
FUSED_MAX_ROWS = 1024
# (rows, N, K, group) whose launch the GPU refused; they stay on int4_linear for the process.
_REFUSED: set[tuple[int, int, int, int]] = set()


def int4_linear_auto(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int = 128,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel on CUDA where it applies and pays (M <= FUSED_MAX_ROWS), else int4_linear's
    product (on CUDA its weight dequantized in one pass: dequant_triton.py, the same bits).

    Both compute the same weight values; they differ only in fp32 summation order, so a caller that
    needs one row's output not to depend on how many rows share the call (true on-policy) should call
    one of them explicitly: the choice here, like the fused kernel's tiles and split, depends on M.
    A launch the GPU refuses for its resources (Triton's OutOfResources: another GPU's shared memory)
    falls back to int4_linear with one warning, instead of failing the run.
    """
    rows = x.numel() // max(x.shape[-1], 1)
    key = (rows, packed.shape[0], x.shape[-1], group)
    if x.is_cuda and rows <= FUSED_MAX_ROWS and key not in _REFUSED \
            and fused_supported(x, packed, scales, group, bias) is None:
        try:
            return int4_linear_fused(x, packed, scales, group, bias)
        except triton.runtime.errors.OutOfResources as e:
            _REFUSED.add(key)
            warnings.warn(f"int4_linear_fused refused on this GPU for {key} ({e}); using int4_linear", stacklevel=2)
    out = one_pass_linear_or_none(x, packed, scales, "int4", bias, group)
    return out if out is not None else int4_linear(x, packed, scales, group, bias)
