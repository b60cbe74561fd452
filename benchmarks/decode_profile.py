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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from gpu_profile import profile_call, report  # noqa: E402
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
                events, wall, host, _ = profile_call(call, args.top)
                print(f"\n# {args.model}, {rows} rows", end="")
                figures = report(name, events, wall, args.new_tokens, args.top, host, CATEGORIES)
                summary.append(dict(rows=rows, recipe=name, **figures))
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
