"""Launch-config sweeps for the project's Triton kernels on one GPU: time and check every candidate.

    python benchmarks/kernel_sweep.py invariant [--json out.json]   # miles/models/invariant_triton.py
    python benchmarks/kernel_sweep.py int4 [--json out.json]        # miles/precision/int4_triton.py, M > 64
    python benchmarks/kernel_sweep.py w8a16 [--json out.json]       # miles/precision/fp8_w8a16_triton.py
    python benchmarks/kernel_sweep.py w4a16 [--json out.json]       # int4_triton.py again, decode rows too
    python benchmarks/kernel_sweep.py w8a16 --rows 256 512 1024      # only these row counts

`invariant`: the batch-invariant matmul (true on-policy mode) at the GEMM shapes of the Qwen3-0.6B
and -4B layers, for every (BLOCK_M, BLOCK_N, warps, stages) candidate and two BLOCK_K values, against
cuBLAS bf16 (`torch.matmul`). Within one BLOCK_K every config must give the same bits for every row
(the invariance the mode rests on): the sweep reports any config that does not.

`int4`: the fused W4A16 kernel at prefill / large-batch decode row counts (M 128-4096) on the 4B
layer shapes, per candidate config (split-K from the kernel's heuristic), against `int4_linear`
(dequantize + cuBLAS) and bf16 `F.linear`; a config the GPU refuses (shared memory) is listed as such.

`w8a16` / `w4a16`: the weight-only kernels (FP8 or INT4 weights, bf16 activations) from decode
(M = 1-64) to prefill (M 4096) on the 4B layer shapes, per candidate config, against bf16 `F.linear`
and the kernel's own reference (dequantize + cuBLAS), all timed as CUDA-graph replays: decode GEMMs
run in the engine's graphs, where Triton's Python launch is gone. Ratios > 1 are faster than bf16.
Each config also counts its outputs whose bits differ from the trainer's GEMM (cuBLAS on a 4096-row
batch holding the decode rows): nonzero is extra train / rollout mismatch (issue 33).

Timing: CUDA events, warm-up first, the median of 20 calls (eager: at these sizes the kernels run
far longer than Triton's launch); graph timings replay 10 captured calls and divide.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_NK = {  # (N, K) of a layer's GEMMs
    "0.6b": [(2048 + 2 * 1024, 1024), (1024, 2048), (2 * 3072, 1024), (1024, 3072)],
    "4b": [(4096 + 2 * 1024, 2560), (2560, 4096), (2 * 9728, 2560), (2560, 9728)],
}


def _time(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sweep_invariant() -> list[dict]:
    from miles.models import invariant_triton as it

    tiles = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3),
             (128, 256, 8, 3), (64, 256, 8, 3), (128, 128, 8, 4), (64, 64, 4, 4)]
    rows = []
    for block_k in (32, 64):
        it.BLOCK_K = block_k
        for (size, shapes), m in itertools.product(QWEN3_NK.items(), (64, 512, 2048, 8192)):
            for n, k in shapes:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
                cublas = _time(lambda: a @ b)
                reference = None
                for tile in tiles:
                    try:
                        out = it.triton_matmul(a, b, torch.bfloat16, tile)
                        ms = _time(lambda: it.triton_matmul(a, b, torch.bfloat16, tile))
                    except Exception as e:  # noqa: BLE001 - a refused config is a result
                        rows.append(dict(kernel="invariant", block_k=block_k, model=size, m=m, n=n, k=k,
                                         tile=tile, error=type(e).__name__))
                        continue
                    reference = out if reference is None else reference
                    head = it.triton_matmul(a[:7], b, torch.bfloat16, tile)  # fewer rows, same bits
                    rows.append(dict(kernel="invariant", block_k=block_k, model=size, m=m, n=n, k=k, tile=tile,
                                     ms=ms, cublas_ms=cublas, vs_cublas=cublas / ms,
                                     same_bits=bool(torch.equal(out, reference) and torch.equal(head, out[:7]))))
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def sweep_int4() -> list[dict]:
    from miles.precision import int4_triton as it
    from miles.precision.int4 import int4_linear, pack_int4, quantize_int4

    candidates = [(64, 128, 64, 4, 3), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 3),
                  (128, 256, 64, 8, 3), (64, 256, 64, 8, 3), (128, 128, 128, 8, 2), (256, 128, 64, 8, 2),
                  (128, 64, 64, 4, 3), (64, 64, 128, 4, 3)]
    rows = []
    for m in (128, 256, 512, 1024, 4096):
        for n, k in QWEN3_NK["4b"]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda") * 0.02
            codes, scales = quantize_int4(w, 128)
            packed = pack_int4(codes)
            wb = w.bfloat16()
            bf16 = _time(lambda: torch.nn.functional.linear(x, wb))
            ref = int4_linear(x, packed, scales, 128)
            dequant = _time(lambda: int4_linear(x, packed, scales, 128))
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            for bm, bn, bk, warps, stages in candidates:
                base = it.pick_config(m, n, k, sms)
                cfg = it.TileConfig(bm, bn, bk, it.split_k(m, n, k, bm, bn, bk, sms), warps, stages)
                row = dict(kernel="int4", m=m, n=n, k=k, config=[bm, bn, bk, cfg.split_k, warps, stages],
                           heuristic=[base.block_m, base.block_n, base.block_k, base.split_k, base.num_warps,
                                      base.num_stages], bf16_ms=bf16, int4_linear_ms=dequant)
                try:
                    out = it.int4_linear_fused(x, packed, scales, 128, config=cfg)
                    ms = _time(lambda: it.int4_linear_fused(x, packed, scales, 128, config=cfg))
                except Exception as e:  # noqa: BLE001 - a refused config is a result
                    row["error"] = type(e).__name__
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row.update(ms=ms, vs_bf16=bf16 / ms, vs_int4_linear=dequant / ms, rel_to_int4_linear=rel)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _time_graph(fn, calls: int = 10, iters: int = 20) -> float:
    """ms per call of `fn` replayed from a CUDA graph of `calls` calls (no launch overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return _time(graph.replay, iters) / calls


WEIGHT_ONLY_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, swap): decode tiles, then large-M tiles
    (16, 64, 256, 4, 4, True), (16, 64, 128, 4, 4, True), (16, 128, 128, 4, 3, True), (16, 32, 256, 4, 4, True),
    (32, 64, 256, 4, 2, True), (64, 64, 256, 4, 2, True), (64, 64, 128, 4, 3, True),
    (128, 64, 64, 4, 3, True), (64, 128, 64, 4, 3, False), (128, 128, 64, 8, 3, False),
    (128, 128, 64, 4, 4, False), (128, 256, 64, 8, 3, False),
    # Compute-bound rows (256-1024, a GRPO rollout's 512): the dequantized weight tile as the left MMA
    # operand (swap; wgmma may take it from registers, no shared-memory round trip) with 128 weight
    # rows over two warpgroups and up to 256 activation rows, so each converted weight element feeds
    # more multiply-adds.
    (128, 128, 64, 8, 3, True), (128, 128, 64, 8, 4, True), (256, 128, 64, 8, 3, True),
    (128, 128, 128, 8, 3, True), (256, 128, 128, 8, 2, True), (64, 128, 128, 8, 3, True),
    (128, 256, 64, 8, 3, True), (128, 64, 128, 4, 4, True), (256, 64, 64, 8, 3, True),
    (256, 128, 64, 8, 3, False),
    # One warpgroup per program and two programs per SM (107 KB of shared memory each at 3 stages):
    # with no barrier between them, one program's dequantization could overlap the other's MMA (an
    # H100 at 512 rows: 0.37-0.50x bf16 on qkv / gate_up, no better than the 8-warp tiles; 256 x 32 x 128 ran at
    # 0.06-0.08x and off the prefill's bits, so it left the list).
    (256, 64, 64, 4, 3, True), (256, 64, 64, 4, 2, True)]


def decode_configs(m: int, n: int, k: int, sms: int) -> list:
    """`--decode`: a wider grid for M <= 256 in one K slice (both weight-only kernels' summation order
    since 2026-12-06): output tile widths both ways (narrow: more programs; wide: fewer re-reads of
    the activations, each program streaming more weight bytes through a deeper pipeline), K depth,
    warps and stages; and each tile split as the heuristic would (~2 programs per SM), for reference."""
    from miles.precision import int4_triton as it

    bm = 16 if m <= 16 else 64
    out = []
    for bn, bk in itertools.product((16, 32, 64, 128, 256), (128, 256)):
        for warps, stages in ((4, 3), (4, 5)) if bn <= 64 else ((4, 4), (8, 4)):
            out.append(it.TileConfig(bm, bn, bk, 1, warps, stages))
        split = it.split_k(m, n, k, bm, bn, bk, sms)
        if split > 1 and bn == 64:
            out.append(it.TileConfig(bm, bn, bk, split, 4, 3))
    # More programs from shorter row tiles instead of narrower column tiles: 64-wide tiles kept the
    # prefill's bits on the H100 (2026-12-06), 16- and 32-wide ones did not; not timed yet at > 16 rows.
    for short, bk in itertools.product((16, 32), (128, 256)):
        if short < bm:
            out.append(it.TileConfig(short, 64, bk, 1, 4, 3))
    return out


def sweep_weight_only(fmt: str, decode: bool = False, only_rows: list[int] | None = None) -> list[dict]:
    """Every candidate config of the W8A16 (fmt "w8a16") or W4A16 ("w4a16") kernel, graph-timed
    (`only_rows`: these row counts instead of the mode's own)."""
    from miles.precision import fp8_w8a16_triton as w8
    from miles.precision import int4_triton as it
    from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight
    from miles.precision.int4 import dequantize_int4, int4_linear, pack_int4, quantize_int4

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for m in only_rows or ((1, 16, 64, 256) if decode else (1, 16, 64, 128, 256, 512, 1024, 4096)):
        for n, k in QWEN3_NK["4b"]:
            batch = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
            x = batch[:m].contiguous()
            w = torch.randn(n, k, device="cuda") * 0.02
            wb = w.bfloat16()
            if fmt == "w8a16":
                q, s = quantize_fp8_weight(w)
                dequantized = dequantize_fp8_weight(q, s, torch.bfloat16)
                reference = lambda: w8.w8a16_linear(x, q, s)  # noqa: E731
                fused = lambda cfg: w8.w8a16_linear_fused(x, q, s, config=cfg)  # noqa: E731
            else:
                codes, s = quantize_int4(w, 128)
                packed = pack_int4(codes)
                dequantized = dequantize_int4(packed, s, 128, k=k, dtype=torch.bfloat16)
                reference = lambda: int4_linear(x, packed, s, 128)  # noqa: E731
                fused = lambda cfg: it.int4_linear_fused(x, packed, s, 128, config=cfg)  # noqa: E731
            # the trainer's / prefill's GEMM (cuBLAS at 4096 rows): a decode output off its bits is a
            # train / rollout mismatch the bf16 recipe does not have (issue 33)
            prefill = torch.nn.functional.linear(batch, dequantized)[:m]
            bf16 = _time_graph(lambda: torch.nn.functional.linear(x, wb))
            ref = reference()
            ref_ms = _time_graph(reference)
            base = w8.pick_w8a16_config(m, n, k, sms) if fmt == "w8a16" else it.pick_config(m, n, k, sms)
            configs = decode_configs(m, n, k, sms) if decode else [
                it.TileConfig(bm, bn, bk, it.split_k(m, n, k, bm, bn, bk, sms), warps, stages, swap=swap)
                for bm, bn, bk, warps, stages, swap in WEIGHT_ONLY_CONFIGS
                if bm <= max(16, 2 * m)]  # tiles of mostly padding rows are skipped
            for cfg in configs + ([] if base in configs else [base]):
                bm, bn, bk, warps, stages, swap = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps,
                                                   cfg.num_stages, cfg.swap)
                row = dict(kernel=fmt, m=m, n=n, k=k, config=[bm, bn, bk, cfg.split_k, warps, stages, swap],
                           heuristic=cfg == base, bf16_ms=bf16, reference_ms=ref_ms)
                try:
                    out = fused(cfg)
                    ms = _time_graph(lambda: fused(cfg))
                except Exception as e:  # noqa: BLE001 - a refused config is a result
                    row["error"] = type(e).__name__
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row.update(ms=ms, vs_bf16=bf16 / ms, vs_reference=ref_ms / ms, rel_to_reference=rel,
                           off_prefill=int((out != prefill).sum()))
                rows.append(row)
                print(json.dumps(row), flush=True)
    best = {}
    for r in rows:
        key = (r["m"], r["n"], r["k"])
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    exact = {}  # the fastest config whose outputs all carry the prefill GEMM's bits
    for r in rows:
        key = (r["m"], r["n"], r["k"])
        if "ms" in r and r["off_prefill"] == 0 and (key not in exact or r["ms"] < exact[key]["ms"]):
            exact[key] = r
    print(f"\nbest {fmt} config per shape (graph-timed ms; x = bf16 ms / kernel ms; config = BM, BN, BK, "
          "split, warps, stages, swap; off = outputs off the prefill GEMM's bits):")
    for (m, n, k), r in sorted(best.items()):
        heur = next((h for h in rows if h["m"] == m and h["n"] == n and h["k"] == k and h["heuristic"] and "ms" in h),
                    None)
        one = exact.get((m, n, k))
        print(f"M={m:5d} N={n:5d} K={k:5d} best {r['config']} {r['ms']:.4f} ms {r['vs_bf16']:.2f}x bf16"
              f" off {r['off_prefill']} | reference {r['bf16_ms'] / r['reference_ms']:.2f}x bf16"
              + (f" | heuristic {heur['vs_bf16']:.2f}x bf16 off {heur['off_prefill']}" if heur else "")
              + (f" | best with the prefill's bits {one['config']} {one['vs_bf16']:.2f}x bf16" if one else
                 " | no config with the prefill's bits"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernel", choices=["invariant", "int4", "w8a16", "w4a16"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--decode", action="store_true", help="w8a16 / w4a16: the wider grid at M <= 256")
    parser.add_argument("--rows", type=int, nargs="+", help="w8a16 / w4a16: only these row counts")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    sweeps = {"invariant": sweep_invariant, "int4": sweep_int4,
              "w8a16": lambda: sweep_weight_only("w8a16", args.decode, args.rows),
              "w4a16": lambda: sweep_weight_only("w4a16", args.decode, args.rows)}
    rows = sweeps[args.kernel]()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
