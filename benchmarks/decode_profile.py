"""Where a decode step's GPU time goes, per precision recipe: kernel time by category from torch.profiler.

    python benchmarks/decode_profile.py [--model qwen3_4b] [--rows 64] [--recipes bf16 fp8 fp8_w8a16 int4]
        [--variants triton sdpa fused]

The engine and workload of `precision_decode.py` (random weights of the model's shape, 128-token
prompts, `--new-tokens` new tokens per row, CUDA graphs). After one warm-up call, one `generate` runs
under the profiler; kernels (those replayed from the decode graphs included) are grouped by name into
weight GEMMs, attention, FP8 activation quantization, split-K reductions and the rest (norms, RoPE,
sampling, bookkeeping), each reported in microseconds per decode step. `busy` is the union of kernel
intervals over the call's wall time: below 100% the GPU waits for the host; the long idle gaps and
the host ops with the most self time say for what. Prints one table per recipe and a summary;
imports torch and miles only.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from precision_decode import MODELS, RECIPES, VARIANTS, build_engine, engine_variants, workload  # noqa: E402
from rollout_gpu import SAMPLES  # noqa: E402

from miles.data.tokenizer import DEFAULT_ALPHABET  # noqa: E402
from miles.orchestrate.checkpoints import random_checkpoint  # noqa: E402

# First match wins: kernel name -> category.
CATEGORIES = [
    ("weight-only GEMM (Triton)", re.compile(r"_w8a16_kernel|_w4a16_kernel")),
    ("split-K reduce", re.compile(r"_splitk_reduce")),
    ("FP8 act quant", re.compile(r"act_quant")),
    ("attention", re.compile(r"sdpa|flash|fmha|attention|_decode_kernel|_merge_kernel", re.I)),
    ("GEMM (cuBLAS / scaled_mm)", re.compile(r"gemm|nvjet|cutlass|xmma|cublas", re.I)),
    ("KV cache write", re.compile(r"index_elementwise|index_put", re.I)),
    ("copy / fill", re.compile(r"memcpy|memset|copy|fill", re.I)),
    ("other", re.compile(r".")),
]


def category(name: str) -> str:
    return next(label for label, pattern in CATEGORIES if pattern.search(name))


def kernel_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def busy_us(events) -> float:
    """Union of the kernels' [start, end) intervals: time the GPU ran something."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (0.0 if cur_end is None else cur_end - cur_start)


def idle_gaps(events, at_least_us: float = 200.0) -> tuple[int, float]:
    """(count, total us) of the GPU's idle gaps of at least `at_least_us` between kernels: long gaps are
    host work the GPU waits for (a host sync, an eager prefill), short ones launch latency."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    count, total, end = 0, 0.0, None
    for start, stop in spans:
        if end is not None and start - end >= at_least_us:
            count, total = count + 1, total + start - end
        end = stop if end is None else max(end, stop)
    return count, total


def host_ops(prof, top: int) -> list[tuple[str, float, int]]:
    """(op, self CPU us, calls) of the host-side ops with the most self time: where the host's time goes."""
    rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CPU]
    return sorted(rows, key=lambda r: -r[1])[:top]


def profile_call(fn, top: int) -> tuple[list, float, list]:
    """The kernels of one call, its wall time in us, and its top host-side ops."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return kernel_events(prof), wall * 1e6, host_ops(prof, top)


def report(recipe: str, events: list, wall_us: float, steps: int, top: int, host: list) -> dict:
    by_cat, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for e in events:
        us = e.time_range.elapsed_us()
        by_cat[category(e.name)] += us
        by_name[e.name] += us
        count[e.name] += 1
    busy = busy_us(events)
    total = max(sum(by_cat.values()), 1e-9)
    print(f"\n## {recipe}: wall {wall_us / steps:.0f} us / step, kernels {sum(by_cat.values()) / steps:.0f} us / step,"
          f" busy {100 * busy / wall_us:.0f}%, {len(events) / steps:.0f} kernels / step")
    print("| category | us / step | share of kernel time |\n|---|---:|---:|")
    for label, _ in CATEGORIES:
        if by_cat[label]:
            print(f"| {label} | {by_cat[label] / steps:.0f} | {100 * by_cat[label] / total:.1f}% |")
    print(f"| top {top} kernels | us / step | calls / step |\n|---|---:|---:|")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| `{name[:90]}` | {us / steps:.1f} | {count[name] / steps:.1f} |")
    gaps, gap_us = idle_gaps(events)
    print(f"GPU idle gaps >= 200 us: {gaps} in the call, {gap_us / steps:.0f} us / step; idle in all: "
          f"{(wall_us - busy) / steps:.0f} us / step")
    print(f"| top {top} host ops (self CPU) | us / step | calls / step |\n|---|---:|---:|")
    for name, us, calls in host:
        print(f"| `{name[:90]}` | {us / steps:.1f} | {calls / steps:.1f} |")
    return dict(recipe=recipe, wall_us=wall_us / steps, busy=busy / wall_us,
                categories={k: v / steps for k, v in by_cat.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3_4b", choices=sorted(MODELS))
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--variants", nargs="+", default=["triton"], choices=VARIANTS)
    args = parser.parse_args()
    model = MODELS[args.model]
    summary = []
    with tempfile.TemporaryDirectory() as work:
        ckpt = str(random_checkpoint(model, DEFAULT_ALPHABET, seed=0, out=f"{work}/m"))
        for rows in args.rows:
            texts, cfg = workload(rows, args.prompt_len, args.new_tokens)
            for name, recipe, variant in engine_variants(args.recipes, args.variants):
                engine = build_engine(ckpt, cfg, recipe, variant)

                def call(e=engine):
                    return e.generate(texts, ["?"] * len(texts), n=SAMPLES)

                call()  # warm-up: graphs captured, kernels compiled
                events, wall, host = profile_call(call, args.top)
                print(f"\n# {args.model}, {rows} rows", end="")
                summary.append(dict(rows=rows, **report(name, events, wall, args.new_tokens, args.top, host)))
                del engine
                torch.cuda.empty_cache()
    labels = [label for label, _ in CATEGORIES]
    print("\n| rows | recipe | us / step | busy | " + " | ".join(labels) + " |")
    print("|---:|---|---:|---:|" + "---:|" * len(labels))
    for s in summary:
        cells = " | ".join(f"{s['categories'].get(label, 0):.0f}" for label in labels)
        print(f"| {s['rows']} | {s['recipe']} | {s['wall_us']:.0f} | {100 * s['busy']:.0f}% | {cells} |")


if __name__ == "__main__":
    main()
