"""A batch-invariant FP8 blockwise GEMM (Triton): one output row's bits do not depend on how many rows share the call.

    y = fp8_gemm_invariant(xq, xs, wq, ws, m, out_dtype)   # xq [M(p), K(p)] fp8, xs [M(p), K/128] fp32 (any strides)

The operands are the DeepSeek-V3 layout of miles/precision/fp8.py: 1x128 activation tiles, 128x128
weight blocks. Each 128-wide K block is one fresh `tl.dot` of the fp8 codes (fp32 result), scaled by
its two block scales and added to an fp32 accumulator, blocks in order from k = 0, never split (the
per-128 promotion DeepSeek-V3 uses). So an output element sees the same instructions on the same
operands whatever M, the tile it sits in or the row count of the call: a decode step (64 rows) and
the training forward (thousands of rows) give the same bits for the same input row. cuBLASLt's
blockwise kernel (`torch._scaled_mm`) picks its algorithm by problem size, which is why it cannot
serve true on-policy mode (tests/gpu/test_fp8_invariant_cuda.py checks both claims).

Tile shapes change with M (wide tiles for throughput, narrow ones for decode parallelism); they change
which program computes an element, not the arithmetic of the element: the GPU test asserts the bits
across every config.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch may come without triton: callers check available()
    triton = None

BLOCK_K = 128  # = the quantization block: one scale pair per dot


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


# (BLOCK_M, BLOCK_N, num_warps, num_stages) by the largest M they serve. Narrow tiles for decode put
# more programs on the GPU's 132 SMs (a 64-row call over N = 1024 has 16 tiles of 64 columns).
CONFIGS = ((64, (64, 64, 4, 4)), (None, (128, 128, 8, 3)))


def pick_config(m: int) -> tuple[int, int, int, int]:
    return next(cfg for limit, cfg in CONFIGS if limit is None or m <= limit)


if triton is not None:

    @triton.jit
    def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                         s_am, s_ak, s_asm, s_ask, s_bn, s_bk, s_bsn, s_bsk, s_cm, s_cn,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        # Grouped program order: GROUP_M row tiles share each weight tile while it sits in L2.
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        group = GROUP_M * tiles_n
        first_m = (pid // group) * GROUP_M
        size_m = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % size_m
        pid_n = (pid % group) // size_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            k = kb * BK + rk
            a = tl.load(a_ptr + rm[:, None] * s_am + k[None, :] * s_ak, mask=(rm[:, None] < M) & (k[None, :] < K),
                        other=0.0)
            b = tl.load(b_ptr + rn[None, :] * s_bn + k[:, None] * s_bk, mask=(k[:, None] < K) & (rn[None, :] < N),
                        other=0.0)
            sa = tl.load(as_ptr + rm * s_asm + kb * s_ask, mask=rm < M, other=0.0)
            sb = tl.load(bs_ptr + (rn // BK) * s_bsn + kb * s_bsk, mask=rn < N, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        c = c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def fp8_gemm_invariant(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, m: int,
                       out_dtype: torch.dtype, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The first m rows of xq (codes [>= m, K'] fp8, K' >= K zero-padded or not) with scales xs
    [>= m, >= ceil(K/128)], times wq [N, K] fp8 with block scales ws [ceil(N/128), ceil(K/128)]
    -> [m, N] in out_dtype. `config` overrides pick_config(m) (the tests run every config)."""
    n, k = wq.shape
    if xq.shape[1] < k or xs.shape[1] * BLOCK_K < k:
        raise ValueError(f"fp8_gemm_invariant: activations of K={xq.shape[1]} for a weight of K={k}")
    bm, bn, warps, stages = config or pick_config(m)
    if BLOCK_K % bn and bn % BLOCK_K:
        raise ValueError(f"BLOCK_N={bn} must divide or be a multiple of {BLOCK_K} (one weight scale row per column)")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_gemm_kernel[grid](xq, xs, wq, ws, out, m, n, k, *xq.stride(), *xs.stride(), *wq.stride(), *ws.stride(),
                           *out.stride(), BM=bm, BN=bn, BK=BLOCK_K, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out
