"""Warp-specialized weight-only GEMMs (Gluon, Hopper): the dequantization off the MMA warps' path.

    y = weight_only_ws_linear(x, codes, scales, "w8a16")   # x [M, K] bf16; e4m3 [N, K] + 128x128 block scales
    y = weight_only_ws_linear(x, packed, scales, "w4a16")  # pack_int4's [N, K/2] + [N, K/128] group scales

Why: at 256-1024 rows (a GRPO rollout decodes 512 at once) a weight-only GEMM is compute-bound, and
the fused Triton kernels (fp8_w8a16_triton.py, int4_triton.py), which convert each weight tile in
the registers of the warps that issue the MMAs, reach about half of cuBLAS bf16 (docs/benchmarks.md,
"Why half of cuBLAS"). Here three partitions share each program, as CUTLASS's mixed-input GEMMs do:

    loader     (1 warp)     TMA: activation tile [BMX, BK] bf16 and code tile (e4m3, or packed int4)
    converter  (2-4 warps)  codes x scale -> bf16 tile in shared memory (the dequantize functions' bits)
    MMA        (default)    wgmma: converted weight tile (A, shared) x activation tile (B, transposed view)

Each output sums K in one pass in wgmma's order with the weight as the left operand, as the fused
kernels' swap does, so its bits should be those of cuBLAS on the dequantized weight.

Status (an H100, Triton 3.6, 2026-12-06; benchmarks/weight_only_ws.py, docs/benchmarks.md): every
config gives cuBLAS's bits on the dequantized weight (0 outputs off the 4096-row GEMM at 256-4096
rows), and none is faster than the alternatives: 0.12-0.79x cuBLAS bf16, against the fused kernels'
0.24-0.56x and the one-pass dequantization + cuBLAS's 0.43-0.95x (FP8). So nothing in the engine calls
it; it stays as the measured baseline for a weight-only GEMM at cuBLAS speed (the converter warps are
the suspect: 2-4 warps convert a 128 x 64 tile while wgmma multiplies it by 128-256 activation rows).
"""

from __future__ import annotations

import torch

try:  # Gluon ships with Triton >= 3.4; without it weight_only_ws_supported() says so
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
except ImportError:  # pragma: no cover - depends on the installed triton
    gluon = None

if gluon is not None:
    SCALE_BLOCK = gl.constexpr(128)  # the FP8 weight's block scales are per 128 x 128
    # Triton 3.9 renamed the TMA load (the GPU machine's 3.6 has only the old name)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def _loader(x_desc, q_desc, x_bufs, q_bufs, w_bufs, bars, s_ptr, stride_sn, off_m, off_n, k_tiles, N):
        # Fills the ring: slot s is free once the converter has read its codes and the MMA its activations.
        ready, empty, w_ready, w_empty = bars
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BKQ: gl.constexpr = q_desc.block_type.shape[1]  # BK codes: BK bytes (FP8) or BK / 2 (INT4)
        STAGES: gl.constexpr = x_bufs.type.shape[0]
        for i in range(k_tiles):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + q_desc.block_type.nbytes)
            _tma_load(x_desc, [off_m, i * BK], ready.index(s), x_bufs.index(s))
            _tma_load(q_desc, [off_n, i * BKQ], ready.index(s), q_bufs.index(s))

    @gluon.jit
    def _take_codes(q_bufs, bars, i, layout: gl.constexpr):
        # Iteration i's code tile out of the ring, its slot released for the loader's next TMA write.
        ready, empty, w_ready, w_empty = bars
        STAGES: gl.constexpr = q_bufs.type.shape[0]
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        raw = q_bufs.index(s).load(layout)
        fence_async_shared()  # the shared read ordered before the next TMA write into the slot
        mbarrier.arrive(empty.index(s), count=1)
        return raw

    @gluon.jit
    def _put_weight(w_bufs, bars, i, w):
        # Iteration i's bf16 weight tile into its slot once the MMA has read the slot's previous tile.
        ready, empty, w_ready, w_empty = bars
        WSTAGES: gl.constexpr = w_bufs.type.shape[0]
        t = i % WSTAGES
        mbarrier.wait(w_empty.index(t), ((i // WSTAGES) & 1) ^ 1)
        w_bufs.index(t).store(w)
        fence_async_shared()  # the generic-proxy store visible to wgmma's async proxy
        mbarrier.arrive(w_ready.index(t), count=1)

    @gluon.jit
    def _converter_fp8(x_desc, q_desc, x_bufs, q_bufs, w_bufs, bars, s_ptr, stride_sn, off_m, off_n, k_tiles, N):
        # e4m3 codes -> fp32 -> x block scale -> bf16, rounded once: dequantize_fp8_weight's bits. A tile
        # of <= 128 rows from a multiple of 128, BK <= 128: one block scale per tile.
        BK: gl.constexpr = w_bufs.type.shape[2]
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
        for i in range(k_tiles):
            raw = _take_codes(q_bufs, bars, i, layout)
            scale = gl.load(s_ptr + (off_n // SCALE_BLOCK) * stride_sn + (i * BK) // SCALE_BLOCK)
            _put_weight(w_bufs, bars, i, (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale).to(gl.bfloat16))

    @gluon.jit
    def _converter_int4(x_desc, q_desc, x_bufs, q_bufs, w_bufs, bars, s_ptr, stride_sn, off_m, off_n, k_tiles, N):
        # Two codes a byte (the even k in the low nibble, value = code - 8) -> fp32 -> x group scale ->
        # bf16, rounded once: dequantize_int4's bits. BK <= the group of 128: one scale per row.
        BNW: gl.constexpr = w_bufs.type.shape[1]
        BK: gl.constexpr = w_bufs.type.shape[2]
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
        byte_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
        rows = off_n + gl.arange(0, BNW, layout=gl.SliceLayout(1, layout))
        for i in range(k_tiles):
            raw = _take_codes(q_bufs, bars, i, byte_layout)
            lo = (raw & 15).to(gl.int32) - 8
            hi = (raw >> 4).to(gl.int32) - 8
            codes = gl.convert_layout(gl.reshape(gl.join(lo, hi), [BNW, BK]), layout)
            scale = gl.load(s_ptr + rows * stride_sn + (i * BK) // SCALE_BLOCK, mask=rows < N, other=1.0)
            _put_weight(w_bufs, bars, i, (codes.to(gl.float32) * scale[:, None]).to(gl.bfloat16))

    @gluon.jit
    def _mma(x_bufs, w_bufs, bars, k_tiles, BNW: gl.constexpr, BMX: gl.constexpr, INSTR_N: gl.constexpr,
             num_warps: gl.constexpr):
        ready, empty, w_ready, w_empty = bars
        STAGES: gl.constexpr = x_bufs.type.shape[0]
        WSTAGES: gl.constexpr = w_bufs.type.shape[0]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, INSTR_N, 16])
        acc = gl.zeros((BNW, BMX), dtype=gl.float32, layout=mma_layout)
        for i in range(k_tiles):
            s = i % STAGES
            t = i % WSTAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            mbarrier.wait(w_ready.index(t), (i // WSTAGES) & 1)
            acc = warpgroup_mma(w_bufs.index(t), x_bufs.index(s).permute((1, 0)), acc, is_async=True)
            # One wgmma in flight: the previous one has finished reading its slots, so release them.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
            mbarrier.arrive(w_empty.index((i + WSTAGES - 1) % WSTAGES), count=1, pred=i > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        return (acc, )  # the default partition's results go back as a tuple

    @gluon.jit
    def weight_only_ws_kernel(x_desc, q_desc, s_ptr, b_ptr, out_ptr, M, N, K, stride_sn, stride_om,
                              HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, WSTAGES: gl.constexpr,
                              INSTR_N: gl.constexpr, CONVERTER_WARPS: gl.constexpr, CONVERTER_REGS: gl.constexpr,
                              INT4: gl.constexpr, num_warps: gl.constexpr):
        BMX: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BNW: gl.constexpr = q_desc.block_type.shape[0]
        off_m = gl.program_id(0) * BMX  # axis 0 fastest: neighbouring programs share the weight tile in L2
        off_n = gl.program_id(1) * BNW
        k_tiles = gl.cdiv(K, BK)  # TMA fills the K tail with zero codes and zero activations

        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BNW, BK], gl.bfloat16)
        w_bufs = gl.allocate_shared_memory(gl.bfloat16, [WSTAGES, BNW, BK], w_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [WSTAGES, 1], mbarrier.MBarrierLayout())
        w_empty = gl.allocate_shared_memory(gl.int64, [WSTAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # the converter (codes) and the MMA (activations)
        for i in gl.static_range(WSTAGES):
            mbarrier.init(w_ready.index(i), count=1)
            mbarrier.init(w_empty.index(i), count=1)
        bars = (ready, empty, w_ready, w_empty)
        worker_args = (x_desc, q_desc, x_bufs, q_bufs, w_bufs, bars, s_ptr, stride_sn, off_m, off_n, k_tiles, N)
        # (the MMA partition's tuple stays inline: bound to a name, its constexprs would become values)
        if INT4:
            results = gl.warp_specialize([(_mma, (x_bufs, w_bufs, bars, k_tiles, BNW, BMX, INSTR_N, num_warps)),
                                          (_loader, worker_args), (_converter_int4, worker_args)],
                                         [1, CONVERTER_WARPS], [24, CONVERTER_REGS])
        else:
            results = gl.warp_specialize([(_mma, (x_bufs, w_bufs, bars, k_tiles, BNW, BMX, INSTR_N, num_warps)),
                                          (_loader, worker_args), (_converter_fp8, worker_args)],
                                         [1, CONVERTER_WARPS], [24, CONVERTER_REGS])
        acc = results[0]

        # Epilogue (all warps of the default partition): + bias in fp32, rounded once, stored as [M, N].
        out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, num_warps], [0, 1])
        acc = gl.convert_layout(acc, out_layout)
        offs_n = off_n + gl.arange(0, BNW, layout=gl.SliceLayout(1, out_layout))
        offs_m = off_m + gl.arange(0, BMX, layout=gl.SliceLayout(0, out_layout))
        n_ok = offs_n < N
        if HAS_BIAS:
            acc = acc + gl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
        mask = n_ok[:, None] & (offs_m < M)[None, :]
        gl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(gl.bfloat16), mask=mask)


# name: (BMX activation rows, BNW weight rows, BK, STAGES, WSTAGES, MMA warps, converter warps, converter
# regs). The launch holds every warp at `maxnreg` registers (setmaxnreg moves them between partitions
# afterwards), so the warps, rounded up to warpgroups, times maxnreg must fit the SM's 64K registers;
# ptxas wants >= 154 for the MMA partition's wgmma (a 128 x 256 or 128 x 128 fp32 accumulator).
CONFIGS = {
    "256x128x64_w8": (256, 128, 64, 3, 2, 8, 2, 160),
    "128x128x64_w4": (128, 128, 64, 4, 2, 4, 4, 120),
    "128x128x128_w4": (128, 128, 128, 3, 2, 4, 4, 152),
}
MAXNREG = 168  # 12 warps (3 warpgroups) x 32 x 168 <= 65,536


def smem_layouts(bmx: int, bnw: int, bk: int, int4: bool):
    """The shared-memory layouts of a config's activation tile and code tile (TMA's and wgmma's)."""
    return (gl.NVMMASharedLayout.get_default_for([bmx, bk], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([bnw, bk // 2 if int4 else bk], gl.uint8))


def weight_only_ws_supported(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: str,
                             bias: torch.Tensor | None = None) -> str | None:
    """None when weight_only_ws_linear takes these operands, else the reason it does not."""
    if gluon is None:
        return "triton.experimental.gluon is not importable"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "the kernel is wgmma's: a Hopper GPU (sm_90) only"
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(-1) != 1:
        return "activations must be a 2-D bf16 matrix with contiguous rows"
    k = x.shape[1]
    if codes.dim() != 2 or codes.stride(-1) != 1 or codes.element_size() != 1:
        return "codes must be a 2-D byte tensor with contiguous rows"
    if k % 32 or x.stride(0) % 8:
        return "TMA needs 16-byte aligned rows: K a multiple of 32"
    if codes.shape[1] != (k // 2 if fmt == "w4a16" else k):
        return f"codes {tuple(codes.shape)} do not fit K={k}"
    if scales.dtype != torch.float32 or scales.shape[1] != -(-k // 128):
        return "scales must be fp32 per 128 columns (the int4 group must be 128)"
    if bias is not None and (bias.shape != (codes.shape[0],) or bias.dtype != x.dtype):
        return "bias must be [N] in x.dtype"
    return None


def pick_ws_config(m: int) -> str:
    """A first guess, not yet timed: 256 activation rows a program from 256 rows, else 128."""
    return "256x128x64_w8" if m >= 256 else "128x128x64_w4"


def weight_only_ws_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: str,
                          bias: torch.Tensor | None = None, config: str | None = None) -> torch.Tensor:
    """x [M, K] bf16 @ W.T (+ bias) -> [M, N] bf16 on Hopper (weight_only_ws_supported says when).
    fmt "w8a16": codes = the e4m3 weight [N, K], scales its [N/128, K/128] block scales; "w4a16":
    codes = pack_int4's [N, K/2] bytes, scales the [N, K/128] group scales (group 128)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bmx, bnw, bk, stages, wstages, warps, cwarps, regs = CONFIGS[config or pick_ws_config(x.shape[0])]
    int4 = fmt == "w4a16"
    m, k = x.shape
    n = codes.shape[0]
    x_layout, q_layout = smem_layouts(bmx, bnw, bk, int4)
    raw = codes.view(torch.uint8)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bmx, bk], x_layout)
    q_desc = TensorDescriptor(raw, list(raw.shape), list(raw.stride()), [bnw, bk // 2 if int4 else bk], q_layout)
    out = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(m, bmx), triton.cdiv(n, bnw))
    weight_only_ws_kernel[grid](x_desc, q_desc, scales, bias if bias is not None else scales, out, m, n, k,
                          scales.stride(0), out.stride(0), HAS_BIAS=bias is not None, STAGES=stages,
                          WSTAGES=wstages, INSTR_N=min(bmx, 256), CONVERTER_WARPS=cwarps, CONVERTER_REGS=regs,
                          INT4=int4, num_warps=warps, maxnreg=MAXNREG)
    return out
