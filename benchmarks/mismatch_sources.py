"""Where the train / rollout mismatch comes from, per precision recipe: the engine's decode against
the engine's own full forward over the same tokens, and that full forward against the trainer's.

    python3 benchmarks/mismatch_sources.py --device cuda --model qwen3_0_6b --recipes bf16 fp8 \\
        fp8,precision.fp8_scheme=w8a8                                   # issue 33, on the GPU
    .venv/bin/python benchmarks/mismatch_sources.py                     # CPU, qwen3_tiny: a smoke run

Each recipe composes the run `launch.py precision=<recipe>` would (warm_start off, ray off, the
`--extra` overrides), starts from the same random checkpoint, builds the engine and the trainer as the
run does (orchestrate/run.py `_spawn_components`), samples one rollout batch and, on its loss
tokens (the means of |a - b| the run's `mismatch/logprob_abs_diff` takes):

  decode - trainer   the run's mismatch: the engine's log-probs while decoding vs the trainer's
  decode - prefill   the engine against itself: decode steps (KV cache, CUDA graphs, decode-shaped
                     GEMMs, weight-only kernels at few rows) vs one full forward of the engine's model
  prefill - trainer  one full forward each: the engine's modules (its rollout format, fused
                     projections, dtype) vs the trainer's (its recipe forward, autocast)

Both sides hold the same weights (the engine quantizes the checkpoint as the trainer's recipe does;
no step is taken). Prints a Markdown table.

`--w8a16-kernel`: which GEMM the w8a16 scheme's decode (<= 1024 rows) takes: `fused` (the engine's:
the Triton kernel of miles/precision/fp8_w8a16_triton.py, one K slice), `split` (the same kernel
split-K where the output tiles leave SMs idle, as it was before 2026-12-06: the source of w8a16's
extra decode - prefill difference), `dequant` (dequantize + cuBLAS, as its prefill and the trainer do).
`--w4a16-kernel`: the same for the INT4 recipes' W4A16 decode GEMM (miles/precision/int4_triton.py),
whose `fused` default still splits K: `unsplit` runs it in one K slice.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def compose(recipe: str, device: str, model: str, extra: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from miles.config.store import register_configs
    from miles.validate import check

    register_configs()
    name, *overrides = recipe.split(",")
    hardware = ["hardware=gpu"] if device == "cuda" else []
    args = [*hardware, f"model={model}", f"precision={name}", *overrides, "warm_start.enabled=false",
            "ray.enabled=false", *extra]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(hydra_compose("config", overrides=args))
    check(cfg)
    return cfg


def prefill_logprobs(engine, tokens: torch.Tensor, temperature: float, rows: int = 8) -> torch.Tensor:
    """[N, T-1] log-probs of tokens[:, 1:] from full forwards of the engine's model (right-padded rows:
    the padding comes after every scored token), `rows` rows per forward."""
    out = []
    with torch.no_grad(), engine._numerics():
        for chunk in tokens.split(rows):
            ids = chunk.to(engine.device)
            logits = engine.model(ids)[:, :-1].float() / temperature
            out.append(logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0].cpu())
    return torch.cat(out)


def measure(recipe: str, args, work: Path) -> dict:
    from miles.data.rewards import get_reward_fn
    from miles.data.source import PromptSource
    from miles.data.tokenizer import TokenizerInfo
    from miles.orchestrate.checkpoints import initial_checkpoint
    from miles.orchestrate.loop import LoopContext, collect_rollout
    from miles.orchestrate.returns import make_train_batch
    from miles.orchestrate.run import _spawn_components

    cfg = compose(recipe, args.device, args.model, args.extra)
    source = PromptSource(cfg.task, cfg.seed)
    ckpt = initial_checkpoint(cfg, source, work)  # the same random weights for every recipe (seeded)
    engine, trainer, _ = _spawn_components(cfg, ckpt, None)
    ctx = LoopContext(engine=engine, trainer=trainer, source=source, tokenizer=TokenizerInfo.load(ckpt),
                      reward_fn=get_reward_fn(cfg.task.reward), log=lambda metrics, step: None)
    samples, _ = collect_rollout(ctx, cfg)
    batch, _ = make_train_batch(ctx, cfg, samples)
    mask = batch.loss_mask.bool()
    decode = batch.rollout_logprobs
    train = trainer.call("logprobs", batch).cpu().float()
    prefill = engine.apply(prefill_logprobs, batch.tokens, cfg.rollout.temperature)
    mean = lambda a, b: float((a - b).abs()[mask].mean())  # noqa: E731
    return {"recipe": recipe, "tokens": int(mask.sum()), "decode_train": mean(decode, train),
            "decode_prefill": mean(decode, prefill), "prefill_train": mean(prefill, train)}


def use_w8a16_kernel(kind: str) -> None:
    """Point the w8a16 decode GEMM at `kind` (module globals, read at every call)."""
    from miles.precision import fp8_w8a16_triton as w8a16

    if kind == "dequant":
        w8a16.FUSED_MAX_ROWS = 0
    elif kind == "split":
        w8a16.SPLIT_K = True


def use_w4a16_kernel(kind: str) -> None:
    """Point the W4A16 decode GEMM at `kind` (module globals, read at every call)."""
    from miles.precision import int4_triton

    if kind == "dequant":
        int4_triton.FUSED_MAX_ROWS = 0
    elif kind == "unsplit":
        int4_triton.SPLIT_K = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="qwen3_tiny")
    parser.add_argument("--recipes", nargs="+", default=["bf16", "fp8"],
                        help="precision recipes, each optionally with overrides after commas")
    parser.add_argument("--extra", nargs="*", default=None,
                        help="launch.py overrides for every recipe (default: 32 prompts x 8 samples x 128 "
                             "tokens on cuda, 48 tokens on the CPU's tiny model)")
    parser.add_argument("--w8a16-kernel", default="fused", choices=["fused", "split", "dequant"],
                        help="the w8a16 decode GEMM: the engine's fused kernel, it split-K, or "
                             "dequantize + cuBLAS")
    parser.add_argument("--w4a16-kernel", default="fused", choices=["fused", "unsplit", "dequant"],
                        help="the int4 recipes' decode GEMM: the engine's fused kernel (split-K), it in one "
                             "K slice, or dequantize + cuBLAS")
    args = parser.parse_args()
    use_w8a16_kernel(args.w8a16_kernel)
    use_w4a16_kernel(args.w4a16_kernel)
    if args.extra is None:
        args.extra = ["rollout.batch_size=32", "rollout.n_samples_per_prompt=8", "trainer.global_batch_size=256",
                      "trainer.micro_batch_size=128", f"rollout.max_new_tokens={128 if args.device == 'cuda' else 48}"]
    with tempfile.TemporaryDirectory() as work:
        rows = [measure(recipe, args, Path(work)) for recipe in args.recipes]
    kernel = "".join(f"; {name} decode GEMM: {kind}" for name, kind in
                     (("w8a16", args.w8a16_kernel), ("w4a16", args.w4a16_kernel)) if kind != "fused")
    print(f"{args.model} on {args.device}{kernel}; mean |log-prob difference| over each batch's loss tokens\n")
    print("| recipe | loss tokens | decode - trainer (the run's mismatch) | decode - prefill | prefill - trainer |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['recipe']} | {r['tokens']:,} | {r['decode_train']:.3e} | {r['decode_prefill']:.3e} "
              f"| {r['prefill_train']:.3e} |")


if __name__ == "__main__":
    main()
