"""The batch-invariant matmul on CUDA (see miles/models/invariant.py): one Triton kernel, one K step.

cuBLAS picks its kernel (tile shape, split-K, stream-K) by problem size, so a row's result changes
with the number of rows. Here every output element accumulates in float32 over K in BLOCK_K steps
from k = 0, never split, each step one `tl.dot` into the running accumulator. An element therefore
sees the same operands in the same order whatever M, N, the batch or its tile position, and zero
terms past the end of its K (masked keys, padding) add nothing: a decode step over the cache and a
full forward give the same bits. fp32 inputs use IEEE products (no TF32).

The output tile (BLOCK_M x BLOCK_N, warps, stages) changes with M: it decides which program computes
an element, not the element's arithmetic, as long as BLOCK_K stays fixed (tests/gpu checks the bits
across both tiles and across row counts; benchmarks/kernel_sweep.py across 9 tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 32  # fixed for every call: it is the accumulation order of every element

# (BLOCK_M, BLOCK_N, num_warps, num_stages): the 64 x 64 tile serves decode-sized calls and batched
# ones (attention's many small products, where small tiles keep more programs resident per SM);
# one 2-D GEMM of more than LARGE_M rows and columns (the trainer's projections) takes the wide tile. From
# `benchmarks/kernel_sweep.py invariant` on one H200 (Qwen3-0.6B / 4B layer GEMMs): at 2048-8192
# rows the wide tile is 1.2-1.8x the small one (0.55-0.7x cuBLAS's speed); below 512 rows they tie.
# fp32 inputs (IEEE FMAs, 4-byte tiles in shared memory) keep the small tile.
SMALL_TILE, WIDE_TILE, LARGE_M = (64, 64, 4, 3), (128, 128, 4, 3), 512


def pick_config(m: int, n: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int]:
    wide = m > LARGE_M and n > LARGE_M and batch == 1 and dtype != torch.float32
    return WIDE_TILE if wide else SMALL_TILE


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                   sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
                   IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # Axis 0 walks (batch, M tile) pairs: CUDA caps grid axes 1 and 2 at 65535, axis 0 at 2^31 - 1.
    m_tiles = tl.cdiv(M, BM)
    pid_m, pid_n, batch = tl.program_id(0) % m_tiles, tl.program_id(1), tl.program_id(0) // m_tiles
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_base = a_ptr + batch * sab + rm[:, None] * sam
    b_base = b_ptr + batch * sbb + rn[None, :] * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_base + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_base + kk[:, None] * sbk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c = c_ptr + batch * scb + rm[:, None] * scm + rn[None, :] * scn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] with broadcast batch dims -> [..., M, N] in out_dtype.
    `config` overrides pick_config(M) (the tests and the sweep run every config)."""
    if a.dtype != b.dtype:
        raise ValueError(f"batch-invariant matmul needs one input dtype, got {a.dtype} and {b.dtype}")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k = a.shape[-2:]
    n = b.shape[-1]
    a3 = a.expand(*batch, m, k).reshape(-1, m, k)  # a view where the batch dims allow it
    b3 = b.expand(*batch, k, n).reshape(-1, k, n)
    bm, bn, warps, stages = config or pick_config(m, n, a3.shape[0], a.dtype)
    out = torch.empty(a3.shape[0], m, n, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, bm) * a3.shape[0], triton.cdiv(n, bn))
    _matmul_kernel[grid](a3, b3, out, m, n, k, *a3.stride(), *b3.stride(), *out.stride(),
                         IEEE=a.dtype == torch.float32, BM=bm, BN=bn, BK=BLOCK_K,
                         num_warps=warps, num_stages=stages)
    return out.reshape(*batch, m, n)
