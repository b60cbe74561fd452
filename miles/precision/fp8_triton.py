"""The 1x128 activation quantizer as one Triton kernel, bitwise equal to `quantize_fp8_act`.

    xq, xs = quantize_act_fused(x2, kp)   # x2 [M, K] on CUDA -> ([Mp, Kp] fp8, [Mp, Kp/128] fp32, strides (1, Mp))

The torch version costs an inf-norm, a division, a clamp, a cast and the pads as separate kernels
(each a pass over the activations); here one program reads a [rows, 128] block once and writes the
codes and the scales in the layout torch._scaled_mm wants (M padded to 16, K to the weight's Kp,
scales outer-dim-major), so the GEMM's operands cost one pass.

Bitwise equal to `quantize_fp8_act` of the zero-padded input (tests/gpu/test_fp8_fused_cuda.py):
the amax of the loaded values is exact, both divisions are IEEE round-to-nearest (`div_rn`; torch's
CUDA division is IEEE too, and Triton's plain `/` on fp32 is not), the clamp is to +-448 and the
fp8 cast rounds to nearest even, as torch's does. Zero tiles (padding) get scale 1 and code 0.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch may come without triton: callers use the torch quantizer
    triton = None

TILE = 128
ROWS = 16  # rows per program: M is padded to 16 for cuBLASLt, so no program straddles the padding


def available(x: torch.Tensor) -> bool:
    """Whether the fused quantizer can run on `x` (a CUDA tensor, triton importable)."""
    return triton is not None and x.is_cuda


if triton is not None:

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, m, k, stride_xm, stride_xk, mp, kp,
                          FP8_MAX: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_m * ROWS + tl.arange(0, ROWS)
        cols = pid_k * TILE + tl.arange(0, TILE)
        inside = (rows[:, None] < m) & (cols[None, :] < k)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=inside, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.math.div_rn(amax, tl.full([ROWS], FP8_MAX, tl.float32))
        scale = tl.where(scale > 0, scale, 1.0)
        q = tl.math.div_rn(x, scale[:, None])
        q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + rows[:, None] * kp + cols[None, :], q.to(tl.float8e4nv))
        # Scales stored [kb, Mp] row-major: the [Mp, kb] outer-dim-major layout scaled_mm reads.
        tl.store(s_ptr + pid_k * mp + rows, scale)


def quantize_act_fused(x2: torch.Tensor, kp: int, m_align: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] bf16 / fp16 / fp32 on CUDA -> (q [Mp, kp] float8_e4m3fn, scale [Mp, kp/128] fp32 with
    strides (1, Mp)); Mp = M rounded up to `m_align` (a multiple of 16), kp a multiple of 128 >= K.
    Any strides: a transposed view (the FP8 backward's tiles along the tokens) is read in place."""
    m, k = x2.shape
    if kp % TILE or kp < k or m_align % ROWS:
        raise ValueError(f"quantize_act_fused: kp={kp} must be a multiple of {TILE} >= K={k}, "
                         f"m_align={m_align} a multiple of {ROWS}")
    mp = -(-m // m_align) * m_align if m else m_align
    q = torch.empty(mp, kp, dtype=torch.float8_e4m3fn, device=x2.device)
    s = torch.empty(kp // TILE, mp, dtype=torch.float32, device=x2.device)
    _act_quant_kernel[(mp // ROWS, kp // TILE)](x2, q, s, m, k, x2.stride(0), x2.stride(1), mp, kp,
                                                FP8_MAX=448.0, ROWS=ROWS, TILE=TILE)
    return q, s.t()
