"""Slot-decode attention (Triton, flash-decoding): one new query per row over its own live columns.

    out = slot_decode_attention(q, k, v, past)   # q [B, H, 1, D]; k / v [B, Hkv, S, D]; past [B]

Row b sees cache columns [0, past[b]] (its earlier tokens and the one just written), the slot mask's
prefix. The SDPA path (`grouped_decode_attention` with that mask) reads all S columns of every row and
runs a prefill kernel whose 64-query tile holds H / Hkv real queries: on one H200 it took 38% of a
512-row Qwen3-4B decode step (8.1 of 21.3 ms, `benchmarks/decode_profile.py`), ~3x the time the rows'
live KV bytes take at the copy bandwidth. Here one program takes one (row, KV head) and the H / Hkv query heads that share it, reads
only the row's live columns in blocks of BLOCK_S (online softmax, fp32 statistics, exp2), and, when
rows x KV heads do not fill the GPU, splits the columns across programs whose partial results a second
kernel merges in split order (deterministic: no atomics). No host syncs, fixed-shape buffers: it is
captured in the decode graphs.

Numerics: q k^T and p v are bf16/fp16 MMAs with fp32 accumulation, p rounded to the value dtype
before p v, as flash kernels do; the result differs from SDPA's by summation order and that rounding
(~1e-3 relative). `applies` says when it is used: CUDA, bf16/fp16, head dims 32 / 64 / 128 / 256, and not
under batch-invariant kernels (true on-policy keeps the SDPA its invariant wrapper replaces).
"""

from __future__ import annotations

import torch

from miles.precision import invariance
from miles.precision.int4_triton import _interpreting, _sm_count

try:  # triton ships with CUDA torch wheels; the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

BLOCK_S = 64
HEAD_DIMS = (32, 64, 128, 256)
MAX_SPLITS = 16
# On/off for the whole process: benchmarks compare the two paths side by side.
enabled = True


def applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether slot decode runs this kernel for these operands (else the SDPA path)."""
    return (enabled and triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and k.dtype == q.dtype and q.shape[2] == 1 and q.shape[-1] in HEAD_DIMS and k.shape[-1] == q.shape[-1]
            and q.shape[1] % k.shape[1] == 0 and not invariance.active())


if triton is not None:
    from miles.precision.int4_triton import _round

    @triton.jit
    def _dot(a, b, INTERPRET: tl.constexpr):
        # The interpreter multiplies bf16 dot operands' raw bits: there the same (exact) products go
        # through an fp32 IEEE dot.
        if INTERPRET:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, past_ptr, out_ptr, ml_ptr, S, chunk, scale_log2,
                       sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
                       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                       SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
        # Program (b, kv head, split): query heads [hk * G, +G) (padded to GP rows for the MMA) over
        # columns [split * chunk, +chunk) of the row's live prefix. Unsplit: the normalised output.
        # Split: the unnormalised fp32 accumulator to out_ptr and (running max, sum) to ml_ptr.
        b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a slot buffer may pass 2^31 elements
        hk = tl.program_id(1)
        sp = tl.program_id(2)
        live = (tl.load(past_ptr + b) + 1).to(tl.int32)
        live = tl.where(live < S, live, S)
        lo = sp * chunk
        hi = tl.where(lo + chunk < live, lo + chunk, live)
        offs_g = tl.arange(0, GP)
        g_ok = offs_g < G
        offs_d = tl.arange(0, D)
        heads = hk * G + offs_g
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        m = tl.full((GP,), float("-inf"), tl.float32)
        l = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        k_base = k_ptr + b * sk_b + hk * sk_h
        v_base = v_ptr + b * sv_b + hk * sv_h
        for s0 in range(lo, hi, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            s_ok = offs_s < hi
            k = tl.load(k_base + offs_s[:, None] * sk_s + offs_d[None, :], mask=s_ok[:, None], other=0.0)
            scores = _dot(q, tl.trans(k), INTERPRET) * scale_log2
            scores = tl.where(s_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_s[:, None] * sv_s + offs_d[None, :], mask=s_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, INTERPRET)
            m = m_new
        o_offs = b * so_b + heads[:, None] * so_h + sp * so_s + offs_d[None, :]
        if SPLIT:
            tl.store(out_ptr + o_offs, acc, mask=g_ok[:, None])
            ml_offs = ((b * (tl.num_programs(1) * G) + heads) * tl.num_programs(2) + sp) * 2
            tl.store(ml_ptr + ml_offs, m, mask=g_ok)
            tl.store(ml_ptr + ml_offs + 1, l, mask=g_ok)
        else:
            out = acc / l[:, None]
            tl.store(out_ptr + o_offs, _round(out, out_ptr.dtype.element_ty, INTERPRET), mask=g_ok[:, None])

    @triton.jit
    def _merge_kernel(part_ptr, ml_ptr, out_ptr, NS, D: tl.constexpr, NSP: tl.constexpr, INTERPRET: tl.constexpr):
        # One (row, head): out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), M = max_s m_s. Split 0
        # always holds column 0, so M is finite; empty splits have m = -inf and weigh 0.
        bh = tl.program_id(0).to(tl.int64)
        offs_s = tl.arange(0, NSP)
        s_ok = offs_s < NS
        m = tl.load(ml_ptr + (bh * NS + offs_s) * 2, mask=s_ok, other=float("-inf"))
        l = tl.load(ml_ptr + (bh * NS + offs_s) * 2 + 1, mask=s_ok, other=0.0)
        w = tl.exp2(m - tl.max(m, 0))
        offs_d = tl.arange(0, D)
        acc = tl.load(part_ptr + (bh * NS + offs_s)[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(out_ptr + bh * D + offs_d, _round(out, out_ptr.dtype.element_ty, INTERPRET))


def splits_for(programs: int, columns: int, sms: int) -> int:
    """Column splits that put ~2 programs on every SM when rows x KV heads alone do not (at most
    MAX_SPLITS, at least one BLOCK_S block each). From the static shape: graph replays keep it."""
    blocks = -(-columns // BLOCK_S)
    return 1 if programs >= 2 * sms else max(1, min(-(-2 * sms // programs), blocks, MAX_SPLITS))


def slot_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: torch.Tensor,
                          splits: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for one query per row over columns [0, past[b]] of its cache.

    q [B, H, 1, D], k / v [B, Hkv, S, D] (any strides with a unit last one), past [B] integer
    -> [B, H, 1, D] in q.dtype. `splits` overrides the column split (tests)."""
    bsz, h, _, d = q.shape
    hkv, cols = k.shape[1], k.shape[2]
    g = h // hkv
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    dev_index = q.device.index if q.is_cuda else None
    ns = splits or splits_for(bsz * hkv, cols, _sm_count(dev_index))
    chunk = -(-(-(-cols // BLOCK_S)) // ns) * BLOCK_S
    ns = -(-cols // chunk)  # no empty splits past the static width
    out = torch.empty((bsz, h, 1, d), device=q.device, dtype=q.dtype)
    scale_log2 = d ** -0.5 * 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x log2 e)
    gp = max(16, triton.next_power_of_2(g))
    common = dict(G=g, GP=gp, D=d, BLOCK_S=BLOCK_S, INTERPRET=_interpreting(), num_warps=4, num_stages=2)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    if ns == 1:
        _decode_kernel[(bsz, hkv, 1)](q, k, v, past, out, out, cols, chunk, scale_log2, *strides,
                                      out.stride(0), out.stride(1), 0, SPLIT=False, **common)
        return out
    part = torch.empty((bsz, h, ns, d), device=q.device, dtype=torch.float32)
    ml = torch.empty((bsz, h, ns, 2), device=q.device, dtype=torch.float32)
    _decode_kernel[(bsz, hkv, ns)](q, k, v, past, part, ml, cols, chunk, scale_log2, *strides,
                                   part.stride(0), part.stride(1), part.stride(2), SPLIT=True, **common)
    _merge_kernel[(bsz * h,)](part, ml, out, ns, D=d, NSP=triton.next_power_of_2(ns),
                              INTERPRET=_interpreting(), num_warps=4)
    return out
