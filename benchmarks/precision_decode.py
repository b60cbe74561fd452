"""Decode speed per precision recipe on one GPU: the native engine (slot decode, CUDA graphs) holding
bf16, FP8 or INT4 weights, each against its own memory roofline.

    python benchmarks/precision_decode.py [--model qwen3_0_6b qwen3_4b qwen3_30b_a3b_4l] [--rows 64 256] [--recipes bf16 fp8 fp8_w8a16 int4]
        [--variants triton sdpa fused] [--w8a16-split-k] [--w4a16-unsplit]
        [--w8a16-fused-max-rows ROWS] [--eager-dequant]

Random weights of the model's published shape, 128-token prompts, exactly `--new-tokens` new tokens
per row (stop ids emptied), 8 samples per prompt, temperature 1; each engine is warmed up once, then
the recipes' calls are interleaved. `--variants`: how each engine decodes, `triton` (the default: the
slot-decode attention kernel of miles/models/decode_attention.py), `sdpa` (the masked SDPA it
replaced), `fused` (triton, plus q / k / v and gate / up as one GEMM each: rollout.fuse_projections),
`dense` (triton, with rollout.dense_weight_copies for the weight-only recipes: calls of > 256 rows
multiply bf16 copies); with several, every recipe runs with each, side by side (`--one-at-a-time`:
each engine alone, for shapes where they do not fit together). Roofline per recipe: a decode step reads every weight once in the
format the engine holds (quantized Linear layers and MoE expert stacks: fp8 1 byte + scales, int4
0.5 byte + scales; the rest, embeddings / head / norms, bf16; a MoE step at 64 rows or more reads
nearly every expert) and each row's KV cache so far:
tok/s <= rows / ((weight bytes + rows * mean context * KV bytes per token) / BW), BW the measured
device-to-device copy bandwidth. Imports torch and miles only (no Hydra / MLflow).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from mismatch_sources import use_w4a16_kernel, use_w8a16_kernel  # noqa: E402
from rollout_gpu import QWEN3_30B_A3B_8L, SAMPLES, copy_bandwidth, prompts, timed  # noqa: E402

from miles.config.schema import DType, FP8Scheme, ModelCfg, PrecisionCfg, Quant, RolloutCfg  # noqa: E402
from miles.data.tokenizer import DEFAULT_ALPHABET  # noqa: E402
from miles.hardware.footprint import kv_bytes_per_token  # noqa: E402
from miles.models import decode_attention  # noqa: E402
from miles.orchestrate.checkpoints import random_checkpoint  # noqa: E402
from miles.precision import dense_copy  # noqa: E402
from miles.precision.recipe import QuantLinear  # noqa: E402
from miles.rollout.native import NativeEngine  # noqa: E402

MODELS = {
    "qwen3_0_6b": ModelCfg(name="qwen3_0_6b", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                           num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                           tie_word_embeddings=True, max_position_embeddings=40960),
    "qwen3_4b": ModelCfg(name="qwen3_4b", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                         num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=40960),
    # MoE: 4 of Qwen3-30B-A3B's 48 layers (128 experts, 8 a token; 2.4B expert weights, a 12 GB fp32
    # checkpoint to write and load per engine): at 64 rows a step reads nearly every expert, and the
    # FP8 / INT4 engines hold the stacks quantized (miles/models/quant_experts.py).
    "qwen3_30b_a3b_4l": replace(QWEN3_30B_A3B_8L, name="qwen3_30b_a3b_4l", num_layers=4),
}


RECIPES = {  # what the engine holds: (precision.rollout_quant, precision.fp8_scheme)
    "bf16": (Quant.none, FP8Scheme.w8a8), "fp8": (Quant.fp8, FP8Scheme.w8a8),
    "fp8_w8a16": (Quant.fp8, FP8Scheme.w8a16), "int4": (Quant.int4, FP8Scheme.w8a8)}


def held_bytes(engine: NativeEngine, rows: int) -> int:
    """Bytes a decode step of `rows` reads: every tensor the engine holds, once (a tied embedding is
    one); where a layer's dense copy serves the call (rollout.dense_weight_copies), the copy instead
    of its payload."""
    tensors = dict(engine.recipe.held_tensors(engine.model))
    for prefix, module in engine.model.named_modules():
        dense = getattr(module, "dense", None) if isinstance(module, QuantLinear) else None
        if dense is not None and dense.numel() and rows >= dense_copy.MIN_ROWS:
            for name in module.buffer_names():
                tensors.pop(f"{prefix}.{name}", None)
            tensors[f"{prefix}.dense"] = dense
    seen, total = set(), 0
    for t in tensors.values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


VARIANTS = ("triton", "sdpa", "fused", "dense")


def engine_variants(recipes: list[str], variants: list[str]) -> list[tuple[str, str, str]]:
    """(name, recipe, variant) per engine to build; the variant shows in the name when several run."""
    return [(recipe if len(variants) == 1 else f"{recipe}/{v}", recipe, v) for recipe in recipes for v in variants]


def workload(rows: int, prompt_len: int, new_tokens: int) -> tuple[list[str], RolloutCfg]:
    """The prompts (rows / SAMPLES groups) and the engine config of one decode measurement."""
    cfg = RolloutCfg(max_new_tokens=new_tokens, max_prompt_len=prompt_len, max_running=rows,
                     n_samples_per_prompt=SAMPLES, temperature=1.0)
    return prompts(rows // SAMPLES, prompt_len), cfg


def build_engine(ckpt: str, cfg: RolloutCfg, recipe: str, variant: str) -> NativeEngine:
    """A bf16 engine holding `recipe`'s format, its decode graphs captured as `variant` decodes."""
    quant, scheme = RECIPES[recipe]
    precision = PrecisionCfg(name=recipe, rollout_quant=quant, fp8_scheme=scheme)
    decode_attention.enabled = variant != "sdpa"
    # The engine quantizes the checkpoint into the recipe's format as it starts.
    engine = NativeEngine(ckpt, replace(cfg, fuse_projections=variant == "fused", dense_weight_copies=variant == "dense"),
                          DType.bf16, device="cuda", seed=0, precision=precision)
    engine.stop_ids = torch.tensor([], dtype=torch.long, device="cuda")
    decode_attention.enabled = True
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["qwen3_0_6b", "qwen3_4b"], choices=sorted(MODELS))
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--variants", nargs="+", default=["triton"], choices=VARIANTS)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--w8a16-split-k", action="store_true",
                        help="the fp8_w8a16 engines' GEMM split-K where tiles leave SMs idle (before "
                             "2026-12-06; miles/precision/fp8_w8a16_triton.py says why it is off)")
    parser.add_argument("--w4a16-unsplit", action="store_true",
                        help="the int4 engines' GEMM in one K slice (miles/precision/int4_triton.py SPLIT_K)")
    parser.add_argument("--w8a16-fused-max-rows", type=int, metavar="ROWS",
                        help="above this many rows the fp8_w8a16 engines dequantize and call cuBLAS "
                             "(fp8_w8a16_triton.FUSED_MAX_ROWS, 256; 1024 before 2026-12-06)")
    parser.add_argument("--eager-dequant", action="store_true",
                        help="that dequantization (both formats) in eager torch, not in one Triton pass "
                             "(miles/precision/dequant_triton.py; before 2026-12-06)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="build, warm and time each engine, then free it before the next (shapes where the "
                             "engines do not fit the GPU together; the recipes' calls are then not interleaved)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.w8a16_fused_max_rows is not None:
        from miles.precision import fp8_w8a16_triton
        fp8_w8a16_triton.FUSED_MAX_ROWS = args.w8a16_fused_max_rows
    if args.eager_dequant:
        from miles.precision import dequant_triton
        dequant_triton.ENABLED = False
    if args.w8a16_split_k:
        use_w8a16_kernel("split")
    if args.w4a16_unsplit:
        use_w4a16_kernel("unsplit")
    bandwidth = copy_bandwidth()
    results = []
    for model_name in args.model:
        model = MODELS[model_name]
        arch = model.arch(model.vocab_size)
        kv_token = kv_bytes_per_token(arch, 2)
        with tempfile.TemporaryDirectory() as work:
            ckpt = str(random_checkpoint(model, DEFAULT_ALPHABET, seed=0, out=f"{work}/m"))
            for rows in args.rows:
                texts, cfg = workload(rows, args.prompt_len, args.new_tokens)
                names = engine_variants(args.recipes, args.variants)
                groups = [[n] for n in names] if args.one_at_a_time else [names]
                for group in groups:
                    engines = {name: build_engine(ckpt, cfg, recipe, variant) for name, recipe, variant in group}
                    calls = {name: (lambda e=e: e.generate(texts, ["?"] * len(texts), n=SAMPLES))
                             for name, e in engines.items()}
                    for fn in calls.values():
                        fn()  # warm-up: graphs captured, kernels compiled
                    times = {name: [] for name in calls}
                    for _ in range(args.repeats):
                        for name, fn in calls.items():
                            times[name].append(timed(fn))
                    context = args.prompt_len + args.new_tokens / 2
                    for name, engine in engines.items():
                        wbytes = held_bytes(engine, rows)
                        step_bytes = wbytes + rows * context * kv_token
                        warm = statistics.median(times[name])
                        results.append(dict(model=model_name, rows=rows, recipe=name, warm_s=warm,
                                            tps=rows * args.new_tokens / warm, weight_gb=wbytes / 1e9,
                                            roofline_tps=rows * bandwidth / step_bytes, bandwidth=bandwidth))
                        print(results[-1], flush=True)
                    del engines, calls
                    torch.cuda.empty_cache()
    print("\n| model | rows | recipe | weights GB | tok/s | vs bf16 | roofline tok/s | % of roofline |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in results:
        base = next(x for x in results if x["model"] == r["model"] and x["rows"] == r["rows"]
                    and x["recipe"] == results[0]["recipe"])
        print(f"| {r['model']} | {r['rows']} | {r['recipe']} | {r['weight_gb']:.2f} | {r['tps']:,.0f} | "
              f"{r['tps'] / base['tps']:.2f}x | {r['roofline_tps']:,.0f} | {100 * r['tps'] / r['roofline_tps']:.1f}% |")
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
