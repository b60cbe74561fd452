"""FP8 blockwise GEMM and INT4 W4A16 against BF16 on real layer shapes, and CPU/GPU quantizer agreement.

    python benchmarks/precision_gemm.py                       # needs a CUDA GPU (Hopper for scaled_mm)
    python benchmarks/precision_gemm.py --tokens 4096 --json out.json

Imports only torch and miles.precision (GPU machines may lack Hydra, Ray, MLflow). One run prints, side
by side for every (projection, token count):
- bf16: F.linear in bf16 (cuBLAS), the baseline;
- fp8 GEMM: the bare torch._scaled_mm call with DeepSeek-style scales (activations 1x128 already
  quantized, weight already laid out): the kernel alone;
- fp8 act quant + GEMM: fp8_linear_prepared, what an engine holding prepared weights runs per call
  (activation quantization in plain torch ops, then the kernel); the act quant time alone is listed;
  fp8_linear, which also lays the weight out on every call, is in the JSON;
- int4: int4_linear (unpack + dequantize in torch ops, then a bf16 GEMM) and its dequantization alone;
- int4 fused: int4_linear_fused, the Triton W4A16 kernel (miles/precision/int4_triton.py) that reads
  the packed nibbles and never writes the bf16 weight; its error against the fp32 reference and its
  distance to int4_linear (only the fp32 summation order differs);
- fp8 triton: the batch-invariant Triton GEMM (miles/precision/fp8_triton_gemm.py) with the fused
  activation quantizer, on a weight prepared once (what `precision.fp8_gemm=triton` and true
  on-policy mode run on both sides);
- deep_gemm: fp8_linear(backend="deep_gemm") (activation quantization + DeepGEMM's NT GEMM), only where
  fp8_backend_report says DeepGEMM loads and computes the right numbers;
- for M <= --graph-max-tokens also the bf16, fp8 (scaled_mm and triton, act quant included) and int4
  fused times inside a CUDA graph (`*_graph_ms`):
  what the engine's graph-captured decoder pays, without the Python launch cost (Triton's launcher
  is much slower than cuBLAS's, so eager decode timings of the fused kernel are CPU-bound);
with speed-ups = bf16 time / time, relative errors against an fp32 GEMM of the same bf16 inputs, and
then the bitwise comparison of the quantizers' outputs (fp8 q bytes + scales, int4 packed bytes +
scales, dequantized weights) computed on the CPU and on the GPU from the same weights.

Timing: CUDA events around each call, warm-up first, the median of --iters calls. TF32 is off so the
fp32 references are fp32. The same weight is used call after call, so a weight that fits in L2 (50 MB
on an H200: every int4 weight here, bf16 up to ~25M parameters) is read from L2 after the first call;
--flush-l2 overwrites a 256 MB buffer before every timed call (outside the events) for cold-weight
numbers, which is what a decode step over many layers sees.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from miles.precision import (  # noqa: E402
    dequantize_fp8_weight,
    dequantize_int4,
    fp8_backend_report,
    fp8_linear,
    fp8_linear_prepared,
    int4_linear,
    pack_int4,
    prepare_scaled_mm_weight,
    quantize_act_for_scaled_mm,
    quantize_fp8_act,
    quantize_fp8_weight,
    quantize_int4,
    resolve_fp8_backend,
    scaled_mm_gemm,
)
from miles.precision.fp8_gemm import fp8_linear_with, prepare_fp8_weight  # noqa: E402
from miles.precision.int4_triton import int4_linear_fused, triton_available  # noqa: E402

# (model, projection, N = out features, K = in features), from the published configs.
SHAPES = [
    ("Qwen3-30B-A3B", "q_proj (32x128)", 4096, 2048),
    ("Qwen3-30B-A3B", "k/v_proj (4x128)", 512, 2048),
    ("Qwen3-30B-A3B", "o_proj", 2048, 4096),
    ("Qwen3-30B-A3B", "expert gate/up", 768, 2048),
    ("Qwen3-30B-A3B", "expert down", 2048, 768),
    ("DeepSeek-V3", "q_a_proj", 1536, 7168),
    ("DeepSeek-V3", "kv_a_proj_with_mqa", 576, 7168),
    ("DeepSeek-V3", "o_proj (128x128)", 7168, 16384),
    ("DeepSeek-V3", "expert gate/up", 2048, 7168),
    ("DeepSeek-V3", "expert down", 7168, 2048),
    ("DeepSeek-V3", "dense gate/up", 18432, 7168),
    ("DeepSeek-V3", "dense down", 7168, 18432),
    # Qwen3-4B: hidden 2560, 32 q / 8 kv heads of 128, intermediate 9728 (where the GEMMs dominate).
    ("Qwen3-4B", "q_proj (32x128)", 4096, 2560),
    ("Qwen3-4B", "k/v_proj (8x128)", 1024, 2560),
    ("Qwen3-4B", "o_proj", 2560, 4096),
    ("Qwen3-4B", "gate/up", 9728, 2560),
    ("Qwen3-4B", "down", 2560, 9728),
    # Qwen3-0.6B: hidden 1024, 16 q / 8 kv heads of 128, intermediate 3072 (the GRPO benchmark's shape).
    ("Qwen3-0.6B", "q_proj (16x128)", 2048, 1024),
    ("Qwen3-0.6B", "k/v_proj (8x128)", 1024, 1024),
    ("Qwen3-0.6B", "o_proj", 1024, 2048),
    ("Qwen3-0.6B", "gate/up", 3072, 1024),
    ("Qwen3-0.6B", "down", 1024, 3072),
]
BITWISE_ROWS = 2048  # row blocks quantize independently, so the first 2048 rows are a faithful sample


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    """bf16 [n, k], Gaussian with per-128x128-block magnitudes spread over 2^-4..2^4 (made on the CPU,
    so the CPU and GPU quantizers see the same bits)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-4, 5, (-(-n // 128), -(-k // 128)), generator=g).float())
    mag = mag.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (torch.randn(n, k, generator=g) * 0.02 * mag).to(torch.bfloat16)


_FLUSH: list[torch.Tensor] = []  # the --flush-l2 buffer, made once


def cuda_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(start, end):
        if _FLUSH:
            _FLUSH[0].zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


def graph_ms(fn, iters: int) -> float:
    """Per-call time of `iters` calls captured in one CUDA graph (the launch cost the engine avoids).
    Back-to-back calls on one weight: L2-warm, like cuda_ms without --flush-l2."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles, cuBLAS picks) outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / iters)
    del graph
    return statistics.median(times)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def bench_gemms(args, dev) -> list[dict]:
    rows = []
    report = fp8_backend_report(dev)
    fp8_ok = report["scaled_mm"].startswith("ok")
    dg_ok = report["deep_gemm"].startswith("ok")
    fused_ok = triton_available()
    tri_ok = report["triton"].startswith("ok")
    for i, (model, proj, n, k) in enumerate(SHAPES):
        if args.models and model not in args.models:
            continue
        w = weight(n, k, seed=i).to(dev)
        q_w, s_w = quantize_fp8_weight(w)
        prepared = prepare_scaled_mm_weight(q_w, s_w) if fp8_ok else None
        tri = prepare_fp8_weight(q_w, s_w, "triton") if tri_ok else None
        q4, s4 = quantize_int4(w, 128)
        p4 = pack_int4(q4)
        for m in args.tokens:
            g = torch.Generator(device=dev).manual_seed(1000 + i)
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            flop = 2.0 * m * n * k
            row = {"model": model, "projection": proj, "N": n, "K": k, "M": m}
            row["bf16_ms"] = cuda_ms(lambda: F.linear(x, w), args.warmup, args.iters)
            if fp8_ok:
                xq, xs = quantize_act_for_scaled_mm(x, prepared.q.shape[1])
                row["fp8_gemm_ms"] = cuda_ms(lambda: scaled_mm_gemm(xq, xs, prepared, torch.bfloat16),
                                             args.warmup, args.iters)
                row["fp8_engine_ms"] = cuda_ms(lambda: fp8_linear_prepared(x, prepared), args.warmup, args.iters)
                row["fp8_linear_ms"] = cuda_ms(lambda: fp8_linear(x, q_w, s_w, backend="scaled_mm"),
                                               args.warmup, args.iters)
                row["act_quant_ms"] = cuda_ms(lambda: quantize_act_for_scaled_mm(x, prepared.q.shape[1]),
                                              args.warmup, args.iters)
            row["int4_ms"] = cuda_ms(lambda: int4_linear(x, p4, s4, 128), args.warmup, args.iters)
            row["int4_dequant_ms"] = cuda_ms(lambda: dequantize_int4(p4, s4, 128, k=k, dtype=torch.bfloat16),
                                             args.warmup, args.iters)
            if fused_ok:
                row["int4_fused_ms"] = cuda_ms(lambda: int4_linear_fused(x, p4, s4, 128), args.warmup, args.iters)
                # Cheap (no fp32 GEMM), so at every M: prefill and decode take different tile configs.
                row["int4_fused_vs_int4"] = rel(int4_linear_fused(x, p4, s4, 128), int4_linear(x, p4, s4, 128).float())
            if tri_ok:
                row["fp8_triton_ms"] = cuda_ms(lambda: fp8_linear_with(x, tri), args.warmup, args.iters)
            if dg_ok:
                row["deep_gemm_ms"] = cuda_ms(lambda: fp8_linear(x, q_w, s_w, backend="deep_gemm"),
                                              args.warmup, args.iters)
            if m <= args.graph_max_tokens:
                row["bf16_graph_ms"] = graph_ms(lambda: F.linear(x, w), args.iters)
                if fused_ok:
                    row["int4_fused_graph_ms"] = graph_ms(lambda: int4_linear_fused(x, p4, s4, 128), args.iters)
                if fp8_ok:
                    row["fp8_engine_graph_ms"] = graph_ms(lambda: fp8_linear_prepared(x, prepared), args.iters)
                if tri_ok:
                    row["fp8_triton_graph_ms"] = graph_ms(lambda: fp8_linear_with(x, tri), args.iters)
            for key in [c for c in row if c.endswith("_ms")]:
                row[key.replace("_ms", "_tflops")] = flop / (row[key] * 1e-3) / 1e12
            if m == args.tokens[0]:  # accuracy once per shape: fp32 references are slow
                ref = F.linear(x.float(), w.float())
                row["bf16_err"] = rel(F.linear(x, w), ref)
                emu = fp8_linear(x, q_w, s_w, backend="emulated", out_dtype=torch.float32)
                row["fp8_quant_err"] = rel(emu, ref)
                if fp8_ok:
                    y8 = fp8_linear(x, q_w, s_w, backend="scaled_mm")
                    row["fp8_kernel_vs_emulated"] = rel(y8, emu)
                    row["fp8_err"] = rel(y8, ref)
                row["int4_err"] = rel(int4_linear(x, p4, s4, 128), ref)
                if fused_ok:
                    row["int4_fused_err"] = rel(int4_linear_fused(x, p4, s4, 128), ref)
                if tri_ok:
                    y8 = fp8_linear_with(x, tri)
                    row["fp8_triton_vs_emulated"] = rel(y8, emu)
                    row["fp8_triton_err"] = rel(y8, ref)
                if dg_ok:
                    y8 = fp8_linear(x, q_w, s_w, backend="deep_gemm")
                    row["deep_gemm_vs_emulated"] = rel(y8, emu)
                    row["deep_gemm_err"] = rel(y8, ref)
                del ref, emu
            rows.append(row)
            r = row
            print(f"  {model:14s} {proj:20s} M={m:6d} bf16 {r['bf16_ms']:8.3f} ms"
                  + (f"  fp8 gemm {r['fp8_gemm_ms']:8.3f} ms ({r['bf16_ms'] / r['fp8_gemm_ms']:.2f}x)"
                     f"  fp8 act quant + GEMM {r['fp8_engine_ms']:8.3f} ms" if fp8_ok else "")
                  + f"  int4 {r['int4_ms']:8.3f} ms"
                  + (f"  int4 fused {r['int4_fused_ms']:8.3f} ms ({r['bf16_ms'] / r['int4_fused_ms']:.2f}x)"
                     if fused_ok else "")
                  + (f"  graph: bf16 {r['bf16_graph_ms']:7.4f} int4 fused {r['int4_fused_graph_ms']:7.4f} ms "
                     f"({r['bf16_graph_ms'] / r['int4_fused_graph_ms']:.2f}x)" if fused_ok and "bf16_graph_ms" in r else "")
                  + (f"  fp8 triton {r['fp8_triton_ms']:8.3f} ms ({r['bf16_ms'] / r['fp8_triton_ms']:.2f}x)"
                     if tri_ok else "")
                  + (f"  graph fp8: scaled_mm {r['fp8_engine_graph_ms']:7.4f} triton {r['fp8_triton_graph_ms']:7.4f} ms"
                     if "fp8_triton_graph_ms" in r and "fp8_engine_graph_ms" in r else "")
                  + (f"  deep_gemm {r['deep_gemm_ms']:8.3f} ms ({r['bf16_ms'] / r['deep_gemm_ms']:.2f}x)"
                     if dg_ok else ""), flush=True)
            del x
        del w, q_w, s_w, prepared, tri, q4, s4, p4
        torch.cuda.empty_cache()
    return rows


def bitwise(args, dev) -> list[dict]:
    rows = []
    seen = set()
    for i, (model, proj, n, k) in enumerate(SHAPES):
        if (n, k) in seen:
            continue
        seen.add((n, k))
        w = weight(n, k, seed=i)[:BITWISE_ROWS]  # CPU bf16
        wd = w.to(dev)
        row = {"shape": f"{n}x{k}", "rows_compared": w.shape[0]}
        t = time.perf_counter()
        qc, sc = quantize_fp8_weight(w)
        qg, sg = quantize_fp8_weight(wd)
        row["fp8_q"] = same(qc, qg)
        row["fp8_scale"] = same(sc, sg)
        row["fp8_dequant_bf16"] = same(dequantize_fp8_weight(qc, sc, torch.bfloat16),
                                       dequantize_fp8_weight(qg, sg, torch.bfloat16))
        for group in (128, 32):
            q4c, s4c = quantize_int4(w, group)
            q4g, s4g = quantize_int4(wd, group)
            pc, pg = pack_int4(q4c), pack_int4(q4g)
            row[f"int4_g{group}_packed"] = same(pc, pg)
            row[f"int4_g{group}_scale"] = same(s4c, s4g)
            row[f"int4_g{group}_dequant_bf16"] = same(dequantize_int4(pc, s4c, group, k=k, dtype=torch.bfloat16),
                                                      dequantize_int4(pg, s4g, group, k=k, dtype=torch.bfloat16))
        g = torch.Generator().manual_seed(7 + i)
        x = (torch.randn(256, k, generator=g) * 3).to(torch.bfloat16)
        xc, xsc = quantize_fp8_act(x)
        xg, xsg = quantize_fp8_act(x.to(dev))
        row["fp8_act_q"] = same(xc, xg)
        row["fp8_act_scale"] = same(xsc, xsg)
        row["seconds"] = time.perf_counter() - t
        rows.append(row)
        flags = {kk: v for kk, v in row.items() if isinstance(v, bool)}
        print(f"  {row['shape']:12s} all equal: {all(flags.values())}  "
              f"{'' if all(flags.values()) else [kk for kk, v in flags.items() if not v]}", flush=True)
    return rows


def quantizer_speed(args, dev) -> list[dict]:
    """GPU time of the quantizers per weight (what weight sync adds per step)."""
    rows = []
    for i, (model, proj, n, k) in enumerate(SHAPES):
        w = weight(n, k, seed=i).to(dev)
        rows.append({"model": model, "projection": proj, "N": n, "K": k,
                     "fp8_weight_quant_ms": cuda_ms(lambda: quantize_fp8_weight(w), 2, 5),
                     "int4_quant_pack_ms": cuda_ms(lambda: pack_int4(quantize_int4(w, 128)[0]), 2, 5)})
        del w
    return rows


def _opt(r: dict, key: str, fmt: str = "{:.3f}") -> str:
    return fmt.format(r[key]) if key in r else "-"


def _speedup(r: dict, base: str, key: str) -> str:
    return f"{r[base] / r[key]:.2f}x" if key in r and base in r else "-"


def table(rows: list[dict], fp8: bool) -> str:
    fused = any("int4_fused_ms" in r for r in rows)
    dg = any("deep_gemm_ms" in r for r in rows)
    tri = any("fp8_triton_ms" in r for r in rows)
    graph = fused and any("bf16_graph_ms" in r for r in rows)
    fp8_graph = any("fp8_triton_graph_ms" in r for r in rows)
    head = ["model", "projection", "N x K", "tokens", "bf16 ms (TFLOP/s)"]
    if fp8:
        head += ["fp8 GEMM ms (TFLOP/s)", "fp8 GEMM speed-up", "fp8 act quant + GEMM ms", "its speed-up",
                 "act quant ms"]
    if tri:
        head += ["fp8 triton (act quant + GEMM) ms", "its speed-up"]
    if dg:
        head += ["deep_gemm (act quant + GEMM) ms", "its speed-up"]
    head += ["int4 ms", "int4 speed-up", "int4 dequant ms"]
    if fused:
        head += ["int4 fused ms", "its speed-up"]
    if graph:
        head += ["in a CUDA graph: bf16 ms", "int4 fused ms", "its speed-up"]
    if fp8_graph:
        head += ["in a CUDA graph: fp8 scaled_mm ms", "its speed-up", "fp8 triton ms", "its speed-up"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["projection"], f"{r['N']}x{r['K']}", str(r["M"]),
                 f"{r['bf16_ms']:.3f} ({r['bf16_tflops']:.0f})"]
        if fp8:
            cells += [f"{r['fp8_gemm_ms']:.3f} ({r['fp8_gemm_tflops']:.0f})", f"{r['bf16_ms'] / r['fp8_gemm_ms']:.2f}x",
                      f"{r['fp8_engine_ms']:.3f}", f"{r['bf16_ms'] / r['fp8_engine_ms']:.2f}x",
                      f"{r['act_quant_ms']:.3f}"]
        if tri:
            cells += [_opt(r, "fp8_triton_ms"), _speedup(r, "bf16_ms", "fp8_triton_ms")]
        if dg:
            cells += [_opt(r, "deep_gemm_ms"), _speedup(r, "bf16_ms", "deep_gemm_ms")]
        cells += [f"{r['int4_ms']:.3f}", f"{r['bf16_ms'] / r['int4_ms']:.2f}x", f"{r['int4_dequant_ms']:.3f}"]
        if fused:
            cells += [_opt(r, "int4_fused_ms"), _speedup(r, "bf16_ms", "int4_fused_ms")]
        if graph:
            cells += [_opt(r, "bf16_graph_ms", "{:.4f}"), _opt(r, "int4_fused_graph_ms", "{:.4f}"),
                      _speedup(r, "bf16_graph_ms", "int4_fused_graph_ms")]
        if fp8_graph:
            cells += [_opt(r, "fp8_engine_graph_ms", "{:.4f}"), _speedup(r, "bf16_graph_ms", "fp8_engine_graph_ms"),
                      _opt(r, "fp8_triton_graph_ms", "{:.4f}"), _speedup(r, "bf16_graph_ms", "fp8_triton_graph_ms")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def err_table(rows: list[dict], fp8: bool) -> str:
    fused = any("int4_fused_err" in r for r in rows)
    dg = any("deep_gemm_err" in r for r in rows)
    head = ["model", "projection", "bf16", "fp8 (quantization, emulated fp32)"]
    head += ["fp8 scaled_mm", "scaled_mm vs emulated"] if fp8 else []
    tri = any("fp8_triton_err" in r for r in rows)
    head += ["fp8 triton", "triton vs emulated"] if tri else []
    head += ["deep_gemm", "deep_gemm vs emulated"] if dg else []
    head += ["int4 g128"]
    head += ["int4 fused", "int4 fused vs int4_linear (max over M)"] if fused else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "bf16_err" not in r:
            continue
        cells = [r["model"], r["projection"], f"{r['bf16_err']:.1e}", f"{r['fp8_quant_err']:.1e}"]
        cells += [f"{r['fp8_err']:.1e}", f"{r['fp8_kernel_vs_emulated']:.1e}"] if fp8 else []
        cells += [_opt(r, "fp8_triton_err", "{:.1e}"), _opt(r, "fp8_triton_vs_emulated", "{:.1e}")] if tri else []
        cells += [_opt(r, "deep_gemm_err", "{:.1e}"), _opt(r, "deep_gemm_vs_emulated", "{:.1e}")] if dg else []
        cells += [f"{r['int4_err']:.1e}"]
        if fused:
            dist = [o["int4_fused_vs_int4"] for o in rows if (o["N"], o["K"]) == (r["N"], r["K"])
                    and o["model"] == r["model"] and o["projection"] == r["projection"] and "int4_fused_vs_int4" in o]
            cells += [_opt(r, "int4_fused_err", "{:.1e}"), f"{max(dist):.1e}" if dist else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 4096, 16384],
                    help="rows of x: 1-64 are decode (memory bound), 4096+ prefill")
    ap.add_argument("--graph-max-tokens", type=int, default=256,
                    help="also time bf16 and the fused int4 kernel inside a CUDA graph up to this many rows")
    ap.add_argument("--flush-l2", action="store_true", help="overwrite 256 MB before each timed call (cold weights)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-bitwise", action="store_true")
    ap.add_argument("--models", nargs="+", default=None, help="only these SHAPES models (e.g. Qwen3-4B DeepSeek-V3)")
    ap.add_argument("--json", type=Path, default=None, help="write every number here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("precision_gemm.py needs a CUDA GPU (the CPU path is covered by tests/unit/precision)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", torch.cuda.current_device())
    if args.flush_l2:
        _FLUSH.append(torch.empty(256 * 2**20, dtype=torch.uint8, device=dev))
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(dev),
           "capability": ".".join(map(str, torch.cuda.get_device_capability(dev))), "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(), "cpu_threads": torch.get_num_threads(),
           "argv": sys.argv}
    print(json.dumps(env))
    report = fp8_backend_report(dev)
    print("fp8 backends:", json.dumps(report, indent=1))
    print("auto picks:", resolve_fp8_backend("auto", dev))
    print("int4 fused (Triton):", "available" if triton_available() else "triton not importable: column skipped")
    fp8 = report["scaled_mm"].startswith("ok")

    out = {"env": env, "fp8_backends": report}
    if not args.skip_bitwise:
        print("\nCPU vs GPU quantizer outputs (bitwise):")
        out["bitwise"] = bitwise(args, dev)
    print("\nGEMMs:")
    out["gemm"] = bench_gemms(args, dev)
    print("\nquantizer speed:")
    out["quantizer_speed"] = quantizer_speed(args, dev)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))

    print("\n## GEMM time (median of %d, CUDA events), speed-up = bf16 time / time\n" % args.iters)
    print(table(out["gemm"], fp8))
    print("\n## Relative error ||y - y_fp32|| / ||y_fp32|| (fp32 GEMM of the same bf16 inputs)\n")
    print(err_table(out["gemm"], fp8))
    print("\n## Quantizer time on the GPU per weight (ms)\n")
    print("| model | projection | N x K | fp8 128x128 quantize | int4 g128 quantize + pack |\n|---|---|---|---|---|")
    for r in out["quantizer_speed"]:
        print(f"| {r['model']} | {r['projection']} | {r['N']}x{r['K']} | {r['fp8_weight_quant_ms']:.3f} | "
              f"{r['int4_quant_pack_ms']:.3f} |")
    if "bitwise" in out:
        flags = [v for r in out["bitwise"] for v in r.values() if isinstance(v, bool)]
        print(f"\n## CPU vs GPU bitwise: {sum(flags)}/{len(flags)} comparisons identical over "
              f"{len(out['bitwise'])} weight shapes (fp8 q/scale/dequant, int4 g128+g32 packed/scale/dequant, "
              f"fp8 activation q/scale)")


if __name__ == "__main__":
    main()
