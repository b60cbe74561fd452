"""Warp-specialized weight-only GEMMs (Gluon, Hopper): the dequantization off the MMA warps' path.

    python3 benchmarks/weight_only_ws.py             # GPU (sm_90): bits and speed, W8A16 and W4A16, 256-1024 rows
    python3 benchmarks/weight_only_ws.py --compile   # no GPU needed: compile for sm_90 and print the structure

Why (docs/benchmarks.md, "Why half of cuBLAS"): at 512 rows, where a GRPO rollout decodes, the
shipped W8A16 / W4A16 kernels convert each weight tile in the registers of the warps that issue the
MMAs and reach about half of cuBLAS bf16; Triton's own GEMM on bf16 weights reaches 0.69-0.81x.
Here three partitions share each program, as CUTLASS's mixed-input GEMMs do:

    loader     (1 warp)     TMA: activation tile [BMX, BK] bf16 and code tile (e4m3, or packed int4)
    converter  (2-4 warps)  codes x scale -> bf16 tile in shared memory (the dequantize functions' bits)
    MMA        (default)    wgmma: converted weight tile (A, shared) x activation tile (B, transposed view)

so the tensor cores wait on neither the loads nor the conversion while the converter keeps up.
Each output still sums K in one pass in wgmma's order (the weight as the left operand, as the
shipped kernels' swap), so its bits should equal cuBLAS's on the dequantized weight; the GPU run
counts outputs off the 4096-row cuBLAS GEMM, as `kernel_sweep.py` does.

An experiment, not wired into the engine: written and compiled for sm_90 on a CPU machine
(Triton 3.6, the GPU machine's version; `--compile`); not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

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
def _converter_fp8(x_desc, q_desc, x_bufs, q_bufs, w_bufs, bars, s_ptr, stride_sn, off_m, off_n, k_tiles, N):
    # e4m3 codes -> fp32 -> x block scale -> bf16, rounded once: dequantize_fp8_weight's bits. A tile
    # of <= 128 rows from a multiple of 128, BK <= 128: one block scale per tile.
    ready, empty, w_ready, w_empty = bars
    BK: gl.constexpr = w_bufs.type.shape[2]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    WSTAGES: gl.constexpr = w_bufs.type.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
    for i in range(k_tiles):
        s = i % STAGES
        t = i % WSTAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        raw = q_bufs.index(s).load(layout)
        fence_async_shared()  # the shared read ordered before the next TMA write into the slot
        mbarrier.arrive(empty.index(s), count=1)
        scale = gl.load(s_ptr + (off_n // SCALE_BLOCK) * stride_sn + (i * BK) // SCALE_BLOCK)
        w = (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale).to(gl.bfloat16)
        mbarrier.wait(w_empty.index(t), ((i // WSTAGES) & 1) ^ 1)
        w_bufs.index(t).store(w)
        fence_async_shared()  # the generic-proxy store visible to wgmma's async proxy
        mbarrier.arrive(w_ready.index(t), count=1)


@gluon.jit
def _converter_int4(x_desc, q_desc, x_bufs, q_bufs, w_bufs, bars, s_ptr, stride_sn, off_m, off_n, k_tiles, N):
    # Two codes a byte (the even k in the low nibble, value = code - 8) -> fp32 -> x group scale ->
    # bf16, rounded once: dequantize_int4's bits. BK <= the group of 128: one scale per row.
    ready, empty, w_ready, w_empty = bars
    BNW: gl.constexpr = w_bufs.type.shape[1]
    BK: gl.constexpr = w_bufs.type.shape[2]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    WSTAGES: gl.constexpr = w_bufs.type.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
    byte_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
    rows = off_n + gl.arange(0, BNW, layout=gl.SliceLayout(1, layout))
    for i in range(k_tiles):
        s = i % STAGES
        t = i % WSTAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        raw = q_bufs.index(s).load(byte_layout)
        fence_async_shared()
        mbarrier.arrive(empty.index(s), count=1)
        lo = (raw & 15).to(gl.int32) - 8
        hi = (raw >> 4).to(gl.int32) - 8
        codes = gl.convert_layout(gl.reshape(gl.join(lo, hi), [BNW, BK]), layout)
        scale = gl.load(s_ptr + rows * stride_sn + (i * BK) // SCALE_BLOCK, mask=rows < N, other=1.0)
        w = (codes.to(gl.float32) * scale[:, None]).to(gl.bfloat16)
        mbarrier.wait(w_empty.index(t), ((i // WSTAGES) & 1) ^ 1)
        w_bufs.index(t).store(w)
        fence_async_shared()
        mbarrier.arrive(w_ready.index(t), count=1)


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
def w8a16_ws_kernel(x_desc, q_desc, s_ptr, b_ptr, out_ptr, M, N, K, stride_sn, stride_om,
                    HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, WSTAGES: gl.constexpr, INSTR_N: gl.constexpr,
                    CONVERTER_WARPS: gl.constexpr, CONVERTER_REGS: gl.constexpr, INT4: gl.constexpr,
                    num_warps: gl.constexpr):
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


def _layouts(bmx: int, bnw: int, bk: int, int4: bool):
    return (gl.NVMMASharedLayout.get_default_for([bmx, bk], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([bnw, bk // 2 if int4 else bk], gl.uint8))


def weight_only_ws_linear(x, codes, scales, fmt: str, bias=None, config: str = "256x128x64_w8"):
    """x [M, K] bf16 @ W.T (+ bias) -> [M, N] bf16 on CUDA (sm_90). fmt "w8a16": codes = the e4m3
    weight [N, K], scales its [N/128, K/128] block scales; "w4a16": codes = pack_int4's [N, K/2]
    bytes, scales the [N, K/128] group scales (group 128)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bmx, bnw, bk, stages, wstages, warps, cwarps, regs = CONFIGS[config]
    int4 = fmt == "w4a16"
    m, k = x.shape
    n = codes.shape[0]
    x_layout, q_layout = _layouts(bmx, bnw, bk, int4)
    raw = codes.view(torch.uint8)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bmx, bk], x_layout)
    q_desc = TensorDescriptor(raw, list(raw.shape), list(raw.stride()), [bnw, bk // 2 if int4 else bk], q_layout)
    out = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(m, bmx), triton.cdiv(n, bnw))
    w8a16_ws_kernel[grid](x_desc, q_desc, scales, bias if bias is not None else scales, out, m, n, k,
                          scales.stride(0), out.stride(0), HAS_BIAS=bias is not None, STAGES=stages,
                          WSTAGES=wstages, INSTR_N=min(bmx, 256), CONVERTER_WARPS=cwarps, CONVERTER_REGS=regs,
                          INT4=int4, num_warps=warps, maxnreg=MAXNREG)
    return out


def compile_only(formats=("w8a16", "w4a16"), configs=tuple(CONFIGS)) -> None:
    """Compile the configs for sm_90 without a GPU and print what the compiler made of each."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for fmt in formats:
        for name in configs:
            bmx, bnw, bk, stages, wstages, warps, cwarps, regs = CONFIGS[name]
            int4 = fmt == "w4a16"
            x_layout, q_layout = _layouts(bmx, bnw, bk, int4)
            sig = {"x_desc": f"tensordesc<bf16[{bmx}, {bk}],{x_layout!r}>",
                   "q_desc": f"tensordesc<u8[{bnw}, {bk // 2 if int4 else bk}],{q_layout!r}>",
                   "s_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                   "stride_sn": "i32", "stride_om": "i32", "HAS_BIAS": "constexpr", "STAGES": "constexpr",
                   "WSTAGES": "constexpr", "INSTR_N": "constexpr", "CONVERTER_WARPS": "constexpr",
                   "CONVERTER_REGS": "constexpr", "INT4": "constexpr", "num_warps": "constexpr"}
            consts = dict(HAS_BIAS=False, STAGES=stages, WSTAGES=wstages, INSTR_N=min(bmx, 256),
                          CONVERTER_WARPS=cwarps, CONVERTER_REGS=regs, INT4=int4, num_warps=warps)
            src = GluonASTSource(fn=w8a16_ws_kernel, signature=sig, constexprs=consts)
            try:
                kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                        options=dict(num_warps=warps, maxnreg=MAXNREG))
            except Exception as e:  # noqa: BLE001 - report and go on to the next config
                print(f"{fmt} {name}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
                continue
            ptx = kernel.asm["ptx"]
            print(f"{fmt} {name}: wgmma {ptx.count('wgmma.mma_async')}, TMA loads "
                  f"{ptx.count('cp.async.bulk.tensor')}, setmaxnreg {ptx.count('setmaxnreg')}, shared "
                  f"{kernel.metadata.shared} B, warps {kernel.metadata.num_warps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 only (no GPU needed)")
    args = parser.parse_args()
    if args.compile:
        compile_only()
        return
    import torch
    from kernel_sweep import QWEN3_NK, _time_graph

    from miles.precision import fp8_w8a16_triton as w8
    from miles.precision import int4_triton as it
    from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight
    from miles.precision.int4 import dequantize_int4, pack_int4, quantize_int4

    torch.backends.cuda.matmul.allow_tf32 = False
    print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
    print("x = cuBLAS bf16 time / kernel time (graph-timed); off = outputs off the 4096-row cuBLAS GEMM's bits")
    for fmt in ("w8a16", "w4a16"):
        for m in (256, 512, 1024):
            for n, k in QWEN3_NK["4b"]:
                batch = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
                x = batch[:m].contiguous()
                w = torch.randn(n, k, device="cuda") * 0.02
                if fmt == "w8a16":
                    codes, scales = quantize_fp8_weight(w)
                    dequantized = dequantize_fp8_weight(codes, scales, torch.bfloat16)
                    shipped = lambda: w8.w8a16_linear_fused(x, codes, scales)  # noqa: E731
                else:
                    q, scales = quantize_int4(w, 128)
                    codes = pack_int4(q)
                    dequantized = dequantize_int4(codes, scales, 128, k=k, dtype=torch.bfloat16)
                    shipped = lambda: it.int4_linear_fused(x, codes, scales, 128)  # noqa: E731
                prefill = torch.nn.functional.linear(batch, dequantized)[:m]
                wb = w.bfloat16()
                bf16 = _time_graph(lambda: torch.nn.functional.linear(x, wb))
                line = (f"{fmt} M={m:5d} N={n:5d} K={k:5d} shipped {bf16 / _time_graph(shipped):.2f}x "
                        f"off {int((shipped() != prefill).sum())}")
                for name in CONFIGS:
                    try:
                        out = weight_only_ws_linear(x, codes, scales, fmt, config=name)
                        ms = _time_graph(lambda: weight_only_ws_linear(x, codes, scales, fmt, config=name))
                        line += f" | {name} {bf16 / ms:.2f}x off {int((out != prefill).sum())}"
                    except Exception as e:  # noqa: BLE001 - a refused config is a result
                        line += f" | {name} {type(e).__name__}: {str(e)[:80]}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
