"""The batch-invariant matmul on CUDA (see miles/models/invariant.py): one Triton kernel, one tile shape.

cuBLAS picks its kernel (tile shape, split-K, stream-K) by problem size, so a row's result changes
with the number of rows. Here every call runs the same program: a BLOCK_M x BLOCK_N output tile
accumulates in float32 over K in BLOCK_K steps from k = 0, never split. An element therefore sees
the same operands in the same tensor-core instructions whatever M, N, the batch or its tile
position, and zero terms past the end of its K (masked keys, padding) add nothing: a decode step
over the cache and a full forward give the same bits. fp32 inputs use IEEE products (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


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


def triton_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] with broadcast batch dims -> [..., M, N] in out_dtype."""
    if a.dtype != b.dtype:
        raise ValueError(f"batch-invariant matmul needs one input dtype, got {a.dtype} and {b.dtype}")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k = a.shape[-2:]
    n = b.shape[-1]
    a3 = a.expand(*batch, m, k).reshape(-1, m, k)  # a view where the batch dims allow it
    b3 = b.expand(*batch, k, n).reshape(-1, k, n)
    out = torch.empty(a3.shape[0], m, n, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, BLOCK_M) * a3.shape[0], triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](a3, b3, out, m, n, k, *a3.stride(), *b3.stride(), *out.stride(),
                         IEEE=a.dtype == torch.float32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                         num_warps=4, num_stages=3)
    return out.reshape(*batch, m, n)
