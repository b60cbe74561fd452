"""Weight dequantization in one pass (Triton): FP8 or INT4 codes and their fp32 scales -> the dense
weight, the bits of `dequantize_fp8_weight` / `dequantize_int4`.

    w = dequantize_one_pass(q, scale, "fp8", torch.bfloat16)                    # e4m3 [N, K], [N/128, K/128]
    w = dequantize_one_pass(packed, scales, "int4", torch.bfloat16, group=128)  # [N, K/2] bytes, [N, K/group]

Why: above the fused kernels' rows (FUSED_MAX_ROWS: prefill, long rollouts) a weight-only GEMM is
compute-bound, and the engine dequantizes and calls cuBLAS. In eager torch that dequantization makes
3 (FP8: an fp32 copy, the scaled product, the cast) or ~8 (INT4: unpack, shift, scale broadcast ...)
passes over the weight, 19+ bytes of traffic a weight where reading the codes and writing the weight
needs 3 (FP8) or 2.5 (INT4, bf16 out). Each element here is code x scale in fp32, rounded once to
`dtype`: the eager functions' arithmetic, so the same bits (tests/unit/precision/test_dequant_triton.py,
in the interpreter on the CPU and compiled on CUDA).
"""

from __future__ import annotations

import torch

from miles.precision.fp8 import BLOCK

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU install has triton; a GPU node without it falls back
    triton = None

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the kernel writes
# Whether the weight-only `*_linear_auto` functions (fp8_w8a16_triton, int4_triton) dequantize in one
# pass on CUDA where they dequantize and call cuBLAS (rows above FUSED_MAX_ROWS): the eager bits, faster
# (docs/benchmarks.md). False: the eager functions (precision_decode.py --eager-dequant compares).
ENABLED = True

if triton is not None:

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, out_ptr, N, K, stride_q, stride_s, stride_o,
                        ROWS_PER_SCALE: tl.constexpr, COLS_PER_SCALE: tl.constexpr, INT4: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr):
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rk = tl.program_id(1) * BK + tl.arange(0, BK)
        mask = (rn < N)[:, None] & (rk < K)[None, :]
        if INT4:  # two codes a byte, the even k in the low nibble; value = code - 8
            byte = tl.load(q_ptr + rn[:, None] * stride_q + (rk // 2)[None, :], mask=mask, other=0)
            code = tl.where((rk % 2 == 0)[None, :], byte & 15, byte >> 4)
            value = (code.to(tl.int32) - 8).to(tl.float32)
        else:
            value = tl.load(q_ptr + rn[:, None] * stride_q + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(s_ptr + (rn // ROWS_PER_SCALE)[:, None] * stride_s + (rk // COLS_PER_SCALE)[None, :],
                        mask=mask, other=0.0)
        tl.store(out_ptr + rn[:, None] * stride_o + rk[None, :], (value * scale).to(out_ptr.dtype.element_ty),
                 mask=mask)


def one_pass_supported(q: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype) -> str | None:
    """None when dequantize_one_pass takes these operands, else the reason it does not."""
    if triton is None:
        return "triton is not importable"
    if q.dim() != 2 or scale.dim() != 2:
        return "one 2-D weight (stacked experts go through the eager functions)"
    if q.stride(-1) != 1 or scale.dtype != torch.float32 or dtype not in _DTYPES:
        return "codes with contiguous rows, fp32 scales, a bf16 / fp16 / fp32 result"
    if fmt not in ("fp8", "int4"):
        return f"format {fmt!r}: fp8 or int4"
    return None


def dequantize_one_pass(q: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype,
                        group: int = 128, k: int | None = None) -> torch.Tensor:
    """The dense [N, K] weight in `dtype` (see the module docstring; one_pass_supported says when).
    INT4: `k` defaults to twice the packed width (pass it for an odd K)."""
    int4 = fmt == "int4"
    n = q.shape[0]
    k = (2 * q.shape[1] if k is None else k) if int4 else q.shape[1]
    out = torch.empty((n, k), device=q.device, dtype=dtype)
    bn, bk = 32, 128
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _dequant_kernel[grid](q.view(torch.uint8) if int4 else q, scale, out, n, k, q.stride(0), scale.stride(0),
                          out.stride(0), ROWS_PER_SCALE=1 if int4 else BLOCK, COLS_PER_SCALE=group if int4 else BLOCK,
                          INT4=int4, BN=bn, BK=bk, num_warps=4)
    return out


def one_pass_weight_or_none(q: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype,
                            group: int = 128, k: int | None = None) -> torch.Tensor | None:
    """dequantize_one_pass where ENABLED, on CUDA and for operands it takes; else None (the caller's
    eager dequantization, the same bits)."""
    if not (ENABLED and q.is_cuda) or one_pass_supported(q, scale, fmt, dtype) is not None:
        return None
    return dequantize_one_pass(q, scale, fmt, dtype, group, k=k)


def one_pass_linear_or_none(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmt: str,
                            bias: torch.Tensor | None, group: int = 128) -> torch.Tensor | None:
    """F.linear(x, the dense weight, bias) through dequantize_one_pass where ENABLED, on CUDA and for
    operands it takes; else None (the caller's eager path, the same bits)."""
    w = one_pass_weight_or_none(q, scale, fmt, x.dtype, group, k=x.shape[-1]) if x.is_cuda else None
    return None if w is None else torch.nn.functional.linear(x, w, bias)
