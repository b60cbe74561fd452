"""LoRA against full fine-tuning, and the engine's two ways to apply adapters, in one process.

    .venv/bin/python benchmarks/lora_speed.py                                     # qwen3_tiny, CPU, ~1 minute
    python benchmarks/lora_speed.py --model qwen3_4b --device cuda --out lora.json  # the issue's H200 shape

Model: conf/model/<model>.yaml's shape with random weights (`random_checkpoint`). Trainer side
(TorchTrainer, GRPO, one optimizer step per call on a synthetic batch of `--samples` x (prompt +
response) random tokens, train_speed.py's): full fine-tuning against LoRA of `--rank` on every
projection; the median step time, the device's peak memory (CUDA), and the sync: get_weights plus
the engine's update_weights, timed together, with the bytes that travel.

Engine side (NativeEngine): decode of `--prompts` x `--n` rows, `--new-tokens` each (no stop ids:
every row decodes them all), after the same trained adapters were synced, for
  base      no LoRA: the base model's speed, what merging can reach
  unmerged  the adapters applied by forward hooks (alpha / r * B(A(x)) per projection; the default)
  merged    trainer.lora.merge_in_engine=true: base + alpha / r * B @ A written into the weights
and the train / rollout mismatch of each LoRA engine: the mean |engine log-prob - trainer log-prob|
over the response tokens of its own samples (the trainer recomputes them with its unmerged
forward). Timing: `--warmup` untimed calls, then the median of `--repeats` (CUDA synchronized); the
three engines' decodes taken in turn within each repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speed import Case, model_cfg, synthetic_batch  # noqa: E402  (a sibling benchmark's batch)

from miles.algo.registry import ADVANTAGES, get  # noqa: E402
from miles.config.schema import AlgoCfg, AlgoName, DType, LoRACfg, PrecisionCfg, RolloutCfg, TrainerCfg  # noqa: E402
from miles.data.tokenizer import DEFAULT_ALPHABET  # noqa: E402
from miles.orchestrate.checkpoints import random_checkpoint  # noqa: E402
from miles.rollout.native import NativeEngine  # noqa: E402
from miles.trainer import offload  # noqa: E402
from miles.trainer.torch_trainer import TorchTrainer  # noqa: E402
from miles.types import build_train_batch  # noqa: E402


_START = time.perf_counter()


def progress(what: str) -> None:
    """One line per phase, with the seconds since start, flushed: a run cut by a time limit says
    how far it got and where the time went."""
    held = f" ({torch.cuda.memory_allocated() / 2**30:.1f} GB allocated)" if torch.cuda.is_available() else ""
    print(f"[{time.perf_counter() - _START:7.1f} s] {what}{held}", flush=True)


def synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed(fn, device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = synced(device)
        fn()
        times.append(synced(device) - start)
    return statistics.median(times)


def interleaved(calls: dict, device, warmup: int, repeats: int) -> dict[str, float]:
    """The median seconds of each call, the calls taken in turn within each repeat (on a shared,
    noisy machine a slow spell then slows every one of them, not one)."""
    times = {name: [] for name in calls}
    for i in range(warmup + repeats):
        for name, fn in calls.items():
            start = synced(device)
            fn()
            if i >= warmup:
                times[name].append(synced(device) - start)
    return {name: statistics.median(t) for name, t in times.items()}


def payload_bytes(weights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def trainer_side(ckpt, lora: LoRACfg, batch, args, device) -> tuple[dict, TorchTrainer]:
    dtype = DType(args.dtype)
    precision = PrecisionCfg(name=args.dtype, train_dtype=dtype, rollout_dtype=dtype)
    cfg = TrainerCfg(lr=args.lr, global_batch_size=batch.tokens.shape[0], micro_batch_size=args.micro_batch,
                     max_tokens_per_micro_batch=args.micro_batch * batch.tokens.shape[1], lora=lora,
                     recompute=args.recompute,
                     offload_optimizer=(args.offload_optimizer and not lora.rank) or None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), cfg, precision, device=str(device), threads=args.threads)
    progress(f"trainer built ({'LoRA' if lora.rank else 'full fine-tuning'})")
    step_s = timed(lambda: trainer.train_rl(batch), device, args.warmup, args.repeats)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    progress(f"trainer steps timed: {step_s:.3f} s a step")
    return dict(step_s=step_s, peak_gb=peak), trainer


def sync_seconds(trainer: TorchTrainer, engine: NativeEngine, device, args) -> tuple[float, int]:
    """get_weights + update_weights with the checksum check, as the loop's checked sync does."""
    weights, digest = trainer.get_weights()
    progress(f"first get_weights: {payload_bytes(weights):,} bytes")

    def one():
        w, d = trainer.get_weights()
        engine.update_weights(w, d)
    return timed(one, device, 1, args.repeats), payload_bytes(weights)


def engine_side(ckpt, lora: LoRACfg | None, prompts, answers, args, device) -> NativeEngine:
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=args.new_tokens, temperature=1.0),
                          dtype=DType(args.dtype), device=str(device), seed=0, threads=args.threads, lora=lora)
    engine.stop_ids = torch.tensor([], dtype=torch.long, device=engine.device)  # every row decodes new_tokens
    return engine


def mismatch(trainer: TorchTrainer, engine: NativeEngine, prompts, answers, args) -> float:
    samples = engine.generate(prompts, answers, n=args.n)
    rewards = torch.zeros(len(samples))
    adv = get(ADVANTAGES, "a", "grpo")(rewards, torch.tensor([s.group for s in samples]))
    batch = build_train_batch(samples, adv, engine.pad_id)
    recomputed = trainer.logprobs(batch).cpu()
    mask = batch.loss_mask.bool()
    return float((recomputed[mask] - batch.rollout_logprobs[mask]).abs().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3_tiny", help="a conf/model/*.yaml name")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--samples", type=int, default=None, help="training rows (default 16 cpu, 64 cuda)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 16 cpu, 128 cuda")
    p.add_argument("--response-len", type=int, default=None, help="default 32 cpu, 256 cuda")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per micro-batch (default 8 cpu, 16 cuda)")
    p.add_argument("--prompts", type=int, default=None, help="decode prompts (default 4 cpu, 64 cuda)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=None, help="default 16 cpu, 256 cuda")
    p.add_argument("--recompute", action="store_true",
                   help="trainer.recompute=true for both trainers (full fine-tuning of the 4B shape needs it on 80 GB)")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="full fine-tuning with AdamW's moments in host memory (trainer.offload_optimizer), as "
                        "the planner sets it for the 4B shape on 80 GB; LoRA keeps its (small) state on the device")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=None, help="default 1 cpu, 2 cuda")
    p.add_argument("--repeats", type=int, default=None, help="default 3 cpu, 5 cuda")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-decode", action="store_true",
                   help="the trainer side and the sync only (the issue's targets); no decode timing")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    cpu = args.device == "cpu"
    pick = lambda value, on_cpu, on_cuda: value if value is not None else (on_cpu if cpu else on_cuda)  # noqa: E731
    args.dtype = pick(args.dtype, "fp32", "bf16")
    args.samples, args.micro_batch = pick(args.samples, 16, 64), pick(args.micro_batch, 8, 16)
    args.prompt_len, args.response_len = pick(args.prompt_len, 16, 128), pick(args.response_len, 32, 256)
    args.prompts, args.new_tokens = pick(args.prompts, 4, 64), pick(args.new_tokens, 16, 256)
    args.warmup, args.repeats = pick(args.warmup, 1, 2), pick(args.repeats, 3, 5)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available")

    lora = LoRACfg(rank=args.rank, alpha=2.0 * args.rank)
    prompts = [f"{i}+{i + 1}=" for i in range(args.prompts)]
    answers = [str(2 * i + 1) for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(random_checkpoint(model_cfg(args.model), DEFAULT_ALPHABET, seed=0, out=Path(tmp) / args.model))
        progress("random checkpoint written")
        vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
        batch = synthetic_batch(Case("lora", args.samples, args.prompt_len, args.response_len, 0), vocab)
        full, full_trainer = trainer_side(ckpt, LoRACfg(), batch, args, device)
        # As a colocated run does before the engine's turn: the full fine-tuning's optimizer state and
        # gradients (~48 GB at the 4B shape) leave the device, or the engine does not fit on 80 GB.
        full_trainer.offload((offload.GRADS, offload.OPTIMIZER))
        progress("full fine-tuning's gradients and optimizer state offloaded")
        base = engine_side(ckpt, None, prompts, answers, args, device)
        progress("engine built")
        full["sync_s"], full["sync_bytes"] = sync_seconds(full_trainer, base, device, args)
        print(f"full fine-tuning: {full}", flush=True)  # progress: a run cut by a time limit keeps it
        del full_trainer
        adapted, trainer = trainer_side(ckpt, lora, batch, args, device)
        print(f"LoRA trainer: {adapted}", flush=True)
        configs = {"unmerged": lora, "merged": LoRACfg(**{**vars(lora), "merge_in_engine": True})}
        rows = args.prompts * args.n * args.new_tokens
        generate = lambda e: (lambda: e.generate(prompts, answers, n=args.n))  # noqa: E731
        decode = {}

        def record(name, engine, seconds_of):
            if args.skip_decode:
                return
            seconds = seconds_of()
            decode[name] = dict(seconds=seconds, tokens_per_s=rows / seconds,
                                mismatch=None if name == "base" else mismatch(trainer, engine, prompts, answers, args))
            print(f"{name} engine: {decode[name]}", flush=True)

        if cpu:  # a shared CPU is noisy: every engine held, their decodes timed in turn
            engines = {"base": base, **{name: engine_side(ckpt, c, prompts, answers, args, device)
                                        for name, c in configs.items()}}
            for name in configs:
                adapted[f"sync_s_{name}"], adapted["sync_bytes"] = sync_seconds(trainer, engines[name], device, args)
            seconds = {} if args.skip_decode else interleaved({name: generate(e) for name, e in engines.items()},
                                                              device, args.warmup, args.repeats)
            for name, engine in engines.items():
                record(name, engine, lambda: seconds[name])
        else:  # 80 GB holds one 4B engine (weights, slot caches) beside the LoRA trainer, not three
            record("base", base, lambda: timed(generate(base), device, args.warmup, args.repeats))
            del base
            for name, c in configs.items():
                torch.cuda.empty_cache()
                engine = engine_side(ckpt, c, prompts, answers, args, device)
                adapted[f"sync_s_{name}"], adapted["sync_bytes"] = sync_seconds(trainer, engine, device, args)
                record(name, engine, lambda: timed(generate(engine), device, args.warmup, args.repeats))
                del engine
    result = dict(args=vars(args), full=full, lora=adapted, decode=decode)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(markdown(result))


def markdown(r: dict) -> str:
    a, full, lo, dec = r["args"], r["full"], r["lora"], r["decode"]
    peak = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [f"{a['model']}, {a['device']}, {a['dtype']}, LoRA rank {a['rank']} on every projection; train "
             f"{a['samples']} x ({a['prompt_len']} + {a['response_len']}), decode {a['prompts']} x {a['n']} rows x "
             f"{a['new_tokens']} tokens", "",
             "| trainer | step s | peak GB | sync s | sync bytes |", "|---|---|---|---|---|",
             f"| full fine-tuning | {full['step_s']:.3f} | {peak(full['peak_gb'])} | {full['sync_s']:.4f} | "
             f"{full['sync_bytes']:,} |",
             f"| LoRA | {lo['step_s']:.3f} ({lo['step_s'] / full['step_s']:.2f}x) | {peak(lo['peak_gb'])} | "
             f"{lo['sync_s_unmerged']:.4f} unmerged, {lo['sync_s_merged']:.4f} merged | {lo['sync_bytes']:,} "
             f"({lo['sync_bytes'] / full['sync_bytes']:.1%}) |", "",
             "| engine | decode s | tokens/s | vs base | mismatch |", "|---|---|---|---|---|"]
    for name, d in dec.items():
        mm = "-" if d["mismatch"] is None else f"{d['mismatch']:.2e}"
        lines.append(f"| {name} | {d['seconds']:.3f} | {d['tokens_per_s']:,.0f} | "
                     f"{d['tokens_per_s'] / dec['base']['tokens_per_s']:.2f}x | {mm} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
