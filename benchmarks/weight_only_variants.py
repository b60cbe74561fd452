"""Where the W8A16 decode GEMM loses to cuBLAS bf16: one Triton skeleton, variants side by side (GPU).

    python3 benchmarks/weight_only_variants.py      # ~4 min on an H100: 4B layer shapes at 1, 16, 64, 512 rows

MODE 0 loads bf16 weights (the skeleton's own ceiling against cuBLAS); MODE 1 FP8 codes with one
block scale a tile, dequantize_fp8_weight's bits (what `pick_w8a16_config` ran at 17-64 rows on 2026-12-05);
MODE 2 FP8 with the scale applied after the dot (a speed bound only: other numerics). LOADS 0
pointer loads, 1 TMA descriptors. Also the shipped kernels (`cur_w8a16`, `cur_w4a16`) and torch's
tinygemm `_weight_int4pack_mm` (bf16 scales, so not exact against int4_linear). Every figure is
cuBLAS bf16 time / variant time, graph-timed (kernel_sweep.py's `_time_graph`); the best config of
(BLOCK_N, split-K, stages) per variant, with its relative error against the reference.
Results: docs/benchmarks.md ("FP8 weight-only GEMM at decode rows, 2026-12-05").
"""
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from kernel_sweep import QWEN3_NK, _time_graph  # noqa: E402

from miles.precision import fp8_w8a16_triton as w8  # noqa: E402
from miles.precision import int4_triton as it  # noqa: E402
from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight  # noqa: E402
from miles.precision.int4 import pack_int4, quantize_int4  # noqa: E402

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception as e:  # noqa: BLE001
    TensorDescriptor = None
    print("no TensorDescriptor:", e)


@triton.jit
def _kern(x_ptr, w_ptr, s_ptr, out_ptr, x_desc, w_desc, M, N, K, k_chunk, stride_xm, stride_wn, stride_sn,
          stride_os, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr,
          LOADS: tl.constexpr, SWAP: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = pid_k * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    rb = (pid_n * BN) // 128
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        if LOADS == 1:
            x = x_desc.load([pid_m * BM, k0])
            raw = w_desc.load([pid_n * BN, k0])
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None], other=0.0)
            raw = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None], other=0)
        if MODE == 0:
            w = raw
        else:
            s = tl.load(s_ptr + rb * stride_sn + k0 // 128)
            if MODE == 1:
                w = (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s).to(tl.bfloat16, fp_downcast_rounding="rtne")
            else:
                w = raw.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        if MODE == 2:
            if SWAP:
                acc += tl.dot(w, tl.trans(x)) * s
            else:
                acc += tl.dot(x, tl.trans(w)) * s
        else:
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
    if SWAP:
        offs = pid_k * stride_os + offs_m[None, :] * N + offs_n[:, None]
        mask = n_ok[:, None] & m_ok[None, :]
    else:
        offs = pid_k * stride_os + offs_m[:, None] * N + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def run(x, w, s, mode, loads, bm, bn, bk, split, warps, stages, swap):
    m, k = x.shape
    n = w.shape[0]
    k_chunk = triton.cdiv(triton.cdiv(k, bk), split) * bk
    split = triton.cdiv(k, k_chunk)
    out = torch.empty((split, m, n), device=x.device, dtype=torch.float32 if split > 1 else torch.bfloat16)
    raw = w if mode == 0 else w.view(torch.uint8)
    xd = wd = None
    if loads == 1:
        xd = TensorDescriptor.from_tensor(x, [bm, bk])
        wd = TensorDescriptor.from_tensor(raw, [bn, bk])
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _kern[grid](x, raw, s, out, xd, wd, m, n, k, k_chunk, x.stride(0), raw.stride(0), s.stride(0), m * n,
                BM=bm, BN=bn, BK=bk, MODE=mode, LOADS=loads, SWAP=swap, num_warps=warps, num_stages=stages)
    return out[0] if split == 1 else out.sum(0).to(torch.bfloat16)


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    best = {}
    for m in (1, 16, 64, 512):
        for n, k in QWEN3_NK["4b"]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda") * 0.02
            wb = w.bfloat16()
            q, s = quantize_fp8_weight(w)
            ref = torch.nn.functional.linear(x, dequantize_fp8_weight(q, s, torch.bfloat16)).float()
            bf16 = _time_graph(lambda: torch.nn.functional.linear(x, wb))
            cur = _time_graph(lambda: w8.w8a16_linear_fused(x, q, s))
            codes, gs = quantize_int4(w, 128)
            packed = pack_int4(codes)
            cur4 = _time_graph(lambda: it.int4_linear_fused(x, packed, gs, 128))
            line = dict(m=m, n=n, k=k, bf16_us=bf16 * 1e3, cur_w8a16=bf16 / cur, cur_w4a16=bf16 / cur4)
            try:  # tinygemm: uint8 [N, K/2] (two 4-bit codes, q + 8), bf16 [K/128, N, 2] scales and zeros
                u = (codes.to(torch.int32) + 8).to(torch.uint8)
                tg = torch._convert_weight_to_int4pack((u[:, ::2] << 4 | u[:, 1::2]).contiguous(), 8)
                sz = torch.stack([gs.t().bfloat16(), torch.zeros_like(gs.t()).bfloat16()], -1).contiguous()
                tgo = torch._weight_int4pack_mm(x, tg, 128, sz)
                line["tinygemm_w4a16"] = bf16 / _time_graph(lambda: torch._weight_int4pack_mm(x, tg, 128, sz))
                deq = (codes.float() * gs.repeat_interleave(128, 1)[:, :k]).bfloat16()
                line["tinygemm_rel"] = ((tgo.float() - x.float() @ deq.float().t()).norm() /
                                        (x.float() @ deq.float().t()).norm()).item()
            except Exception as e:  # noqa: BLE001
                line["tinygemm_error"] = f"{type(e).__name__}: {str(e)[:120]}"
            print(json.dumps(line), flush=True)
            bm = max(16, min(128, triton.next_power_of_2(m)))
            for mode, loads, bn, split, warps, stages in itertools.product(
                    (0, 1, 2), (0, 1), (64, 128), (1, 2, 4, 8), (4,), (3, 4)):
                if loads == 1 and TensorDescriptor is None:
                    continue
                tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                if split > 1 and tiles * split > 4 * sms:
                    continue
                swap = m <= 64
                wt = wb if mode == 0 else q
                key = (m, n, k, mode, loads)
                try:
                    out = run(x, wt, s, mode, loads, bm, bn, 128, split, warps, stages, swap)
                    ms = _time_graph(lambda: run(x, wt, s, mode, loads, bm, bn, 128, split, warps, stages, swap))
                except Exception as e:  # noqa: BLE001
                    print("error", key, bn, split, stages, type(e).__name__, str(e)[:200], flush=True)
                    continue
                r = ref if mode else (x.float() @ wb.float().t())
                rel = ((out.float() - r).norm() / r.norm()).item()
                if key not in best or ms < best[key][0]:
                    best[key] = (ms, bf16 / ms, (bn, split, stages), rel)
    print("\nbest per (m, n, k, mode, loads): x bf16 cuBLAS, config (bn, split, stages), rel err")
    for key, (ms, x, cfg, rel) in sorted(best.items()):
        print(key, f"{x:.2f}x", cfg, f"{rel:.1e}")


if __name__ == "__main__":
    main()
