"""The warp-specialized weight-only GEMMs (miles/precision/weight_only_ws.py) against cuBLAS and the fused kernels.

    python3 benchmarks/weight_only_ws.py             # GPU (sm_90): bits and speed, W8A16 and W4A16, 256-1024 rows
    python3 benchmarks/weight_only_ws.py --compile   # no GPU needed: compile for sm_90 and print the structure
    python3 benchmarks/weight_only_ws.py --smoke     # GPU: one small GEMM per format and config (run it
                                                     # under `timeout` first: a wrong barrier phase hangs)

Per 4B layer shape and row count: cuBLAS bf16 time / kernel time (graph-timed, kernel_sweep.py's
`_time_graph`) for the shipped fused kernel, dequantize + cuBLAS (eager, and the one-pass kernel of
miles/precision/dequant_triton.py) and every warp-specialized config, each with its
outputs off the bits of the trainer's GEMM (cuBLAS on a 4096-row batch holding the rows), as
`kernel_sweep.py` counts them. `--compile` checks what the compiler makes of each config (wgmma,
TMA loads, setmaxnreg, shared memory, warps) on any machine with Triton's ptxas.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from miles.precision.weight_only_ws import (CONFIGS, MAXNREG, smem_layouts, weight_only_ws_kernel,  # noqa: E402
                                            weight_only_ws_linear)


def compile_only(formats=("w8a16", "w4a16"), configs=tuple(CONFIGS)) -> None:
    """Compile the configs for sm_90 without a GPU and print what the compiler made of each."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for fmt in formats:
        for name in configs:
            bmx, bnw, bk, stages, wstages, warps, cwarps, regs = CONFIGS[name]
            int4 = fmt == "w4a16"
            x_layout, q_layout = smem_layouts(bmx, bnw, bk, int4)
            sig = {"x_desc": f"tensordesc<bf16[{bmx}, {bk}],{x_layout!r}>",
                   "q_desc": f"tensordesc<u8[{bnw}, {bk // 2 if int4 else bk}],{q_layout!r}>",
                   "s_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                   "stride_sn": "i32", "stride_om": "i32", "HAS_BIAS": "constexpr", "STAGES": "constexpr",
                   "WSTAGES": "constexpr", "INSTR_N": "constexpr", "CONVERTER_WARPS": "constexpr",
                   "CONVERTER_REGS": "constexpr", "INT4": "constexpr", "num_warps": "constexpr"}
            consts = dict(HAS_BIAS=False, STAGES=stages, WSTAGES=wstages, INSTR_N=min(bmx, 256),
                          CONVERTER_WARPS=cwarps, CONVERTER_REGS=regs, INT4=int4, num_warps=warps)
            src = GluonASTSource(fn=weight_only_ws_kernel, signature=sig, constexprs=consts)
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


def smoke() -> None:
    """One 256 x 2560 x 2560 GEMM per format and config against F.linear on the dequantized weight:
    exits non-zero on a wrong result (a hang is for the caller's `timeout` to catch)."""
    from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight
    from miles.precision.int4 import dequantize_int4, pack_int4, quantize_int4

    x = torch.randn(256, 2560, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2560, 2560, device="cuda") * 0.02
    q8, s8 = quantize_fp8_weight(w)
    q4, s4 = quantize_int4(w, 128)
    cases = {"w8a16": (q8, s8, dequantize_fp8_weight(q8, s8, torch.bfloat16)),
             "w4a16": (pack_int4(q4), s4, dequantize_int4(pack_int4(q4), s4, 128, k=2560, dtype=torch.bfloat16))}
    worst = 0.0
    for fmt, (codes, scales, dequantized) in cases.items():
        ref = torch.nn.functional.linear(x, dequantized).float()
        for name in CONFIGS:
            out = weight_only_ws_linear(x, codes, scales, fmt, config=name)
            torch.cuda.synchronize()
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            worst = max(worst, rel)
            print(f"{fmt} {name}: relative error {rel:.2e}, outputs off cuBLAS's bits {int((out.float() != ref).sum())}",
                  flush=True)
    sys.exit(0 if worst < 1e-2 else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 only (no GPU needed)")
    parser.add_argument("--smoke", action="store_true", help="one small GEMM per format and config, checked")
    parser.add_argument("--no-ws", action="store_true", help="leave the warp-specialized configs out")
    args = parser.parse_args()
    if args.compile:
        compile_only()
        return
    if args.smoke:
        smoke()
        return
    from kernel_sweep import QWEN3_NK, _time_graph

    from miles.precision import fp8_w8a16_triton as w8
    from miles.precision import int4_triton as it
    from miles.precision.dequant_triton import dequantize_one_pass
    from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight
    from miles.precision.int4 import dequantize_int4, pack_int4, quantize_int4

    torch.backends.cuda.matmul.allow_tf32 = False
    print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
    print("x = cuBLAS bf16 time / kernel time (graph-timed); off = outputs off the 4096-row cuBLAS GEMM's bits")
    for fmt in ("w8a16", "w4a16"):
        for m in (256, 512, 1024, 4096):
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
                kind = "int4" if fmt == "w4a16" else "fp8"
                one_pass = lambda: torch.nn.functional.linear(  # noqa: E731
                    x, dequantize_one_pass(codes, scales, kind, torch.bfloat16, group=128, k=k))
                eager = lambda: torch.nn.functional.linear(  # noqa: E731
                    x, dequantize_fp8_weight(codes, scales, torch.bfloat16) if kind == "fp8"
                    else dequantize_int4(codes, scales, 128, k=k, dtype=torch.bfloat16))
                line = (f"{fmt} M={m:5d} N={n:5d} K={k:5d} shipped {bf16 / _time_graph(shipped):.2f}x "
                        f"off {int((shipped() != prefill).sum())} | eager dequant + cuBLAS "
                        f"{bf16 / _time_graph(eager):.2f}x | one-pass dequant + cuBLAS {bf16 / _time_graph(one_pass):.2f}x "
                        f"off {int((one_pass() != prefill).sum())}")
                print(line, end="", flush=True)  # before the warp-specialized configs: a hang keeps these
                line = ""
                for name in () if args.no_ws else CONFIGS:
                    try:
                        out = weight_only_ws_linear(x, codes, scales, fmt, config=name)
                        ms = _time_graph(lambda: weight_only_ws_linear(x, codes, scales, fmt, config=name))
                        line += f" | {name} {bf16 / ms:.2f}x off {int((out != prefill).sum())}"
                    except Exception as e:  # noqa: BLE001 - a refused config is a result
                        line += f" | {name} {type(e).__name__}: {str(e)[:80]}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
