"""Speculative rollout: the draft's accept length over an RL run (online-trained vs frozen), and rollout
speed with and without speculation, side by side in one process.

    python benchmarks/speculative.py accept --steps 200 --model glm4_moe_tiny --kind mtp
    python benchmarks/speculative.py accept --steps 200 --model qwen3_tiny --kind draft_model --draft qwen3_tiny_draft
    python benchmarks/speculative.py accept --steps 100 --model qwen3_tiny --kind draft_model --draft qwen3_tiny \
        --lrs 1e-3 3e-4 1e-4 --arms online frozen          # the draft's learning rate
    python benchmarks/speculative.py speed [--device cuda --dtype bf16 --shape qwen3_0_6b] [--rows 8 32 128]

accept: three runs of the default experiment (warm start, arithmetic, GRPO), in-process, same seed:
`online` (rollout.speculative.train_online=true), `frozen` (the same draft, never trained after the
warm start) and `off` (no speculation: the reference for learning and rollout speed). The MTP
modules are pretrained with the policy in the warm start, a draft model has its own warm start.
Reported from each run's journal: spec/accept_len averaged over windows of steps, spec/draft_loss,
held-out accuracy at step 0 and at the end, and the median rollout/tokens_per_s.

speed: a target of `--shape` with random weights and a draft model (`--draft-shape`), the draft
first trained for `--train-steps` steps on the target's own responses (the next-token loss online
training uses; random prompts, `--temperature`). Then one engine per side, the same prompts, each
warmed up, timed calls interleaved, `--new-tokens` per row exactly (stop ids emptied):
  plain          the engine's default decode (slots + CUDA graphs on a GPU, padded on the CPU)
  plain padded   the padded path (the CPU default; on the GPU, eager with a growing mask)
  spec k=K       speculative decoding with K draft tokens per verify step (slots + graphs on a GPU)
  spec padded    the padded speculative path (k=3), the one MTP drafts use
Reported: tokens/s, the ratio to `plain`, and the accept length (tokens per verify step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from miles.config.schema import (AlgoCfg, AlgoName, DType, ModelCfg, PrecisionCfg, RolloutCfg,  # noqa: E402
                                 SpeculativeCfg, TrainerCfg)
from miles.data.tokenizer import DEFAULT_ALPHABET  # noqa: E402
from miles.orchestrate.checkpoints import random_checkpoint  # noqa: E402
from miles.rollout.native import NativeEngine  # noqa: E402
from miles.types import build_train_batch  # noqa: E402

SHAPES = {
    # the tiny zoo's qwen3 and its one-layer draft (conf/model/qwen3_tiny.yaml, qwen3_tiny_draft.yaml)
    "qwen3_tiny": dict(hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32),
    "qwen3_tiny_draft": dict(hidden_size=64, intermediate_size=192, num_layers=1, num_heads=2, num_kv_heads=1,
                             head_dim=32),
    # Qwen3-0.6B (the GPU rollout benchmark's shape) and a two-layer draft of half its width
    "qwen3_0_6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, rope_theta=1e6),
    "qwen3_0_6b_draft": dict(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
                             num_kv_heads=4, head_dim=64, rope_theta=1e6),
}


# ------------------------------------------------------------------------------------------ accept
def accept(args) -> None:
    from async_rollout import run as launch  # launch.py in a subprocess, its journal's metrics by step

    spec = [f"rollout.speculative.kind={args.kind}", f"rollout.speculative.num_tokens={args.k}"]
    if args.kind == "mtp":
        spec.append("model.mtp_layers=1")
    else:
        spec.append(f"rollout.speculative.draft_model={args.draft}")
    base = [f"model={args.model}", "ray.enabled=false", *args.extra]
    arms = {"online": spec + ["rollout.speculative.train_online=true"],
            "frozen": spec + ["rollout.speculative.train_online=false"],
            "off": (["model.mtp_layers=1"] if args.kind == "mtp" else [])}
    arms = {arm: arms[arm] for arm in args.arms}
    if args.lrs:  # a learning-rate sweep: one online arm per rate, in place of the default-rate one
        online = arms.pop("online", spec + ["rollout.speculative.train_online=true"])
        arms = {**{f"online, lr {lr}": online + [f"rollout.speculative.lr={lr}"] for lr in args.lrs}, **arms}
    windows = [(1, 20), (21, 50), (51, 100), (101, 150), (151, args.steps)]
    windows = [(a, min(b, args.steps)) for a, b in windows if a <= args.steps]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, overrides in arms.items():
            out = Path(tmp) / "".join(c if c.isalnum() else "_" for c in arm)  # launch.py overrides take the path
            out.mkdir()
            results[arm] = launch("synchronous", args.seed, args.steps, base + overrides, out)
    acc = next(k for k in next(iter(results.values()))[0] if k.startswith("eval/") and k.endswith("/accuracy"))
    head = " | ".join(f"accept len {a}-{b}" for a, b in windows)
    print(f"| arm | {head} | draft loss first / last | acc step 0 | acc step {args.steps} | rollout tok/s |")
    print("|---|" + "---:|" * (len(windows) + 4))
    for arm, metrics in results.items():
        series = lambda key: {s: m[key] for s, m in metrics.items() if key in m}  # noqa: E731
        lens, loss = series("spec/accept_len"), series("spec/draft_loss")
        cells = [f"{statistics.mean(v for s, v in lens.items() if a <= s <= b):.3f}" if lens else "-"
                 for a, b in windows]
        loss_cell = f"{loss[min(loss)]:.3f} / {loss[max(loss)]:.3f}" if loss else "-"
        tps = statistics.median(m["rollout/tokens_per_s"] for s, m in metrics.items() if s > 1 and
                                "rollout/tokens_per_s" in m)
        print(f"| {arm} | {' | '.join(cells)} | {loss_cell} | {metrics[0][acc]:.3f} | "
              f"{metrics[args.steps][acc]:.3f} | {tps:,.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({arm: {str(s): m for s, m in ms.items()} for arm, ms in results.items()}))


# ------------------------------------------------------------------------------------------ speed
def prompts(count: int, length: int, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    digits = "0123456789+-*="
    return ["".join(digits[i] for i in torch.randint(0, len(digits), (length - 1,), generator=gen)) for _ in range(count)]


def train_draft(draft_dir: str, target: NativeEngine, args, device: str, out: str) -> None:
    """The draft learns the target's responses (the next-token loss of online draft training), then is saved."""
    from miles.trainer.torch_trainer import TorchTrainer

    rows = args.train_rows
    cfg = TrainerCfg(lr=args.train_lr, global_batch_size=rows, micro_batch_size=rows)
    fp = PrecisionCfg(name="bf16" if args.dtype == "bf16" else "fp32", train_dtype=DType(args.dtype),
                      rollout_dtype=DType(args.dtype))
    trainer = TorchTrainer(draft_dir, AlgoCfg(name=AlgoName.sft, policy_loss="nll"), cfg, fp, device=device)
    for step in range(args.train_steps):
        texts = prompts(rows // 8, args.prompt_len, seed=1000 + step)
        samples = target.generate(texts, ["?"] * len(texts), n=8, temperature=args.temperature,
                                  max_new_tokens=args.train_new_tokens)
        m = trainer.train_sft(build_train_batch(samples, torch.zeros(len(samples)), target.pad_id))
        if step % max(1, args.train_steps // 5) == 0 or step == args.train_steps - 1:
            print(f"  draft step {step}: loss {m['train/loss']:.3f}", flush=True)
    trainer.save(out)
    from miles.orchestrate.checkpoints import copy_tokenizer

    copy_tokenizer(draft_dir, out)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def speed(args) -> None:
    device = args.device
    dtype = DType(args.dtype)
    with tempfile.TemporaryDirectory() as work:
        target_cfg = ModelCfg(name=args.shape, max_position_embeddings=4096, tie_word_embeddings=True,
                              **SHAPES[args.shape])
        draft_cfg = ModelCfg(name=args.draft_shape, max_position_embeddings=4096, tie_word_embeddings=True,
                             **SHAPES[args.draft_shape])
        target_dir = str(random_checkpoint(target_cfg, DEFAULT_ALPHABET, 0, f"{work}/target"))
        draft_dir = str(random_checkpoint(draft_cfg, DEFAULT_ALPHABET, 1, f"{work}/draft"))
        teacher = NativeEngine(target_dir, RolloutCfg(max_new_tokens=args.train_new_tokens,
                                                      max_prompt_len=args.prompt_len, max_running=args.train_rows),
                               dtype, device=device, seed=0)
        teacher.stop_ids = torch.tensor([], dtype=torch.long, device=device)
        start = time.perf_counter()
        train_draft(draft_dir, teacher, args, device, f"{work}/draft_trained")
        print(f"draft trained in {time.perf_counter() - start:.1f} s", flush=True)
        del teacher
        results = []
        for rows in args.rows:
            texts = prompts(rows // 8, args.prompt_len, seed=rows)
            base = RolloutCfg(max_new_tokens=args.new_tokens, max_prompt_len=args.prompt_len, max_running=rows,
                              n_samples_per_prompt=8, temperature=args.temperature)
            sides = {"plain": base}
            if not args.skip_padded:
                sides["plain padded"] = replace(base, slot_decode=False)
            for k in args.k:
                sides[f"spec k={k}"] = replace(base, speculative=SpeculativeCfg(kind="draft_model", num_tokens=k))
            if not args.skip_padded:
                sides["spec padded k=3"] = replace(base, slot_decode=False,
                                                   speculative=SpeculativeCfg(kind="draft_model", num_tokens=3))
            calls = {}
            for name, cfg in sides.items():
                start = time.perf_counter()
                engine = NativeEngine(target_dir, cfg, dtype, device=device, seed=0,
                                      draft_dir=f"{work}/draft_trained" if cfg.speculative.kind != "none" else None)
                print(f"  rows {rows} {name}: engine built in {time.perf_counter() - start:.1f} s", flush=True)
                none = torch.tensor([], dtype=torch.long, device=device)
                engine.stop_ids = none  # exactly new_tokens per row
                if engine.spec is not None:
                    engine.spec.stop_ids = none
                calls[name] = engine
            stats, times = {}, {name: [] for name in calls}
            for name, engine in calls.items():  # warm-up: kernels chosen, graphs captured
                start = time.perf_counter()
                engine.generate(texts, ["?"] * len(texts), n=8)
                print(f"  rows {rows} {name}: first call {time.perf_counter() - start:.1f} s", flush=True)
            for _ in range(args.repeats):
                for name, engine in calls.items():
                    sync()
                    t0 = time.perf_counter()
                    samples = engine.generate(texts, ["?"] * len(texts), n=8)
                    sync()
                    times[name].append(time.perf_counter() - t0)
                    drafts = [s.draft_stats for s in samples if s.draft_stats]
                    if drafts:
                        steps = sum(d[0] for d in drafts)
                        stats[name] = (sum(d[1] for d in drafts) + steps) / steps
            for name in calls:
                warm = statistics.median(times[name])
                results.append(dict(rows=rows, side=name, warm_s=warm, tps=rows * args.new_tokens / warm,
                                    accept_len=stats.get(name)))
                print(f"  rows {rows} {name}: {warm:.3f} s, accept len {stats.get(name)}", flush=True)
            del calls
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{args.shape} target, {args.draft_shape} draft, {args.dtype}, {device}, temperature {args.temperature}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens per row, draft trained {args.train_steps} steps")
    print("| rows | side | warm s | tok/s | vs plain | accept len |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in results:
        base = next(x for x in results if x["rows"] == r["rows"] and x["side"] == "plain")
        acc = f"{r['accept_len']:.2f}" if r["accept_len"] else "-"
        print(f"| {r['rows']} | {r['side']} | {r['warm_s']:.3f} | {r['tps']:,.0f} | "
              f"{base['warm_s'] / r['warm_s']:.2f}x | {acc} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("accept")
    a.add_argument("--steps", type=int, default=200)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--model", default="glm4_moe_tiny")
    a.add_argument("--kind", default="mtp", choices=["mtp", "draft_model"])
    a.add_argument("--draft", default="qwen3_tiny_draft")
    a.add_argument("--k", type=int, default=3)
    a.add_argument("--arms", nargs="+", default=["online", "frozen", "off"], choices=["online", "frozen", "off"])
    a.add_argument("--lrs", nargs="+", default=[], help="online arms at these draft learning rates")
    a.add_argument("--extra", nargs="*", default=[], help="more launch.py overrides for every arm")
    a.add_argument("--json")
    s = sub.add_parser("speed")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    s.add_argument("--shape", default="qwen3_tiny", choices=list(SHAPES))
    s.add_argument("--draft-shape", default="qwen3_tiny_draft", choices=list(SHAPES))
    s.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    s.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    s.add_argument("--prompt-len", type=int, default=16)
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--train-steps", type=int, default=100)
    s.add_argument("--train-rows", type=int, default=64)
    s.add_argument("--train-new-tokens", type=int, default=64)
    s.add_argument("--train-lr", type=float, default=5e-4)
    s.add_argument("--skip-padded", action="store_true", help="no padded sides (on a GPU: slow, not its path)")
    s.add_argument("--json")
    args = parser.parse_args()
    accept(args) if args.mode == "accept" else speed(args)


if __name__ == "__main__":
    main()
