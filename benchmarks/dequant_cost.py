"""What the in-loop FP8 -> bf16 conversion costs a compute-bound Triton GEMM (GPU, ~1 minute).

    python3 benchmarks/dequant_cost.py     # 4B layer shapes at 512 / 1024 rows (a GRPO rollout's decode)

One Triton skeleton (the weight tile as the left MMA operand, as the shipped weight-only kernels do),
two tiles, four weight loads, side by side with cuBLAS bf16 (`F.linear`), all graph-timed:

    MODE 0  bf16 weights: the skeleton's own ceiling
    MODE 1  e4m3 codes converted to bf16 (no scale)
    MODE 2  e4m3 codes to fp32, times a scale, rounded to bf16 (what the W8A16 kernel computes)
    MODE 3  MODE 2 with the conversion done by integer ops: the code's bits placed in an fp32
            (value * 2^-120) and the re-bias folded into the scale; checked to give MODE 2's bits

Then the structure of the shipped W8A16 kernel as compiled here (wgmma count, which loads are
pipelined as async copies, registers, shared memory) for two large tiles. Results: docs/benchmarks.md
("Seventh session").
"""

import re
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from kernel_sweep import _time_graph  # noqa: E402

from miles.precision import fp8_w8a16_triton as w8  # noqa: E402
from miles.precision import int4_triton as it  # noqa: E402
from miles.precision.fp8 import quantize_fp8_weight  # noqa: E402

@triton.jit
def _skeleton(x_ptr, w_ptr, o_ptr, M, N, K, sxm, swn, som, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              MODE: tl.constexpr):
    # Shapes divide the tiles (no masks). acc = W_tile @ x_tile^T, as the weight-only kernels' swap.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    om = pid_m * BM + tl.arange(0, BM)
    on = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ok = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + om[:, None] * sxm + ok[None, :])
        w = tl.load(w_ptr + on[:, None] * swn + ok[None, :])
        if MODE == 1:
            w = w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        if MODE == 2:
            w = (w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 0.5).to(tl.bfloat16)
        if MODE == 3:
            b = w.to(tl.int32)
            f = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
            w = (f * (0.5 * 1.329227995784916e36)).to(tl.bfloat16)  # 0.5 * 2^120
        acc = tl.dot(w, tl.trans(x), acc)
    tl.store(o_ptr + om[None, :] * som + on[:, None], acc.to(tl.bfloat16))


def compiled_structure(kernel) -> list[str]:
    """One line per compiled variant of `kernel` (Triton's per-device cache)."""
    lines = []
    for cache in kernel.device_caches.values():
        for ck in cache[0].values():
            ttgir, ptx = ck.asm["ttgir"], ck.asm["ptx"]
            copies = sorted(set(re.findall(r"async_copy_global_to_local .*?: tensor<([^,]+),", ttgir)))
            lines.append(f"wgmma {ptx.count('wgmma.mma_async')}, mma.sync {ptx.count('mma.sync')}, async copies "
                         f"{copies}, loads not pipelined {len(re.findall(r'= tt.load', ttgir))}, registers "
                         f"{ck.n_regs}, spills {ck.n_spills}, shared {ck.metadata.shared} B, warps "
                         f"{ck.metadata.num_warps}")
    return lines


def main() -> None:
    print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
    tiles = [(256, 128, 64, 8, 3), (128, 128, 64, 8, 4)]  # (x rows, weight rows, BK, warps, stages)
    for m, n, k in [(512, 19456, 2560), (512, 2560, 9728), (1024, 6144, 2560)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wf = torch.randn(n, k, device="cuda") * 0.02
        wb = wf.bfloat16()
        raw = quantize_fp8_weight(wf)[0].view(torch.uint8)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        times = {"cuBLAS bf16": _time_graph(lambda: torch.nn.functional.linear(x, wb))}
        for bm, bn, bk, warps, stages in tiles:
            grid = (m // bm, n // bn)
            for mode, w in ((0, wb), (1, raw), (2, raw), (3, raw)):
                times[f"MODE {mode} {bm}x{bn}x{bk} w{warps} s{stages}"] = _time_graph(
                    lambda: _skeleton[grid](x, w, out, m, n, k, k, k, n, BM=bm, BN=bn, BK=bk, MODE=mode,
                                            num_warps=warps, num_stages=stages))
        outs = {}
        for mode in (2, 3):
            outs[mode] = torch.empty_like(out)
            _skeleton[(m // 128, n // 128)](x, raw, outs[mode], m, n, k, k, k, n, BM=128, BN=128, BK=64, MODE=mode,
                                            num_warps=8, num_stages=3)
        print(f"M={m} N={n} K={k}: MODE 3 outputs off MODE 2's bits: {int((outs[2] != outs[3]).sum())}")
        for name, ms in times.items():
            print(f"  {name:28s} {ms * 1e3:7.1f} us {2 * m * n * k / ms / 1e9:5.0f} TFLOP/s "
                  f"{times['cuBLAS bf16'] / ms:5.2f}x cuBLAS")
    x = torch.randn(512, 2560, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_fp8_weight(torch.randn(19456, 2560, device="cuda") * 0.02)
    for bm, bn, bk, warps, stages in [(256, 128, 64, 8, 3), (256, 64, 64, 4, 3)]:
        w8.w8a16_linear_fused(x, q, s, config=it.TileConfig(bm, bn, bk, 1, warps, stages, swap=True))
    print("the W8A16 kernel as compiled:", *compiled_structure(w8._w8a16_kernel), sep="\n  ")


if __name__ == "__main__":
    main()
