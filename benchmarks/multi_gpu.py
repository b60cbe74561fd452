"""Multi-GPU runs on one host without Ray (issue 16): the device machines carry no Ray, so the ranks
here are torch.multiprocessing processes, one per GPU (gloo and CPU processes with `--device cpu`).

    python benchmarks/multi_gpu.py fsdp --device cuda --ranks 1 2 4 8 --model qwen3_0_6b
    python benchmarks/multi_gpu.py broadcast --device cuda --engines 1 2 4 --models qwen3_0_6b qwen3_1_7b qwen3_4b
    python benchmarks/multi_gpu.py fleet --device cuda --engines 1 2 4 --model qwen3_0_6b
    .venv/bin/python benchmarks/multi_gpu.py fsdp --device cpu --ranks 1 2 --model qwen3_tiny   # the same on gloo

fsdp: `--steps` GRPO train_rl calls on one synthetic global batch (benchmarks/train_speed.py's `fixed`
case: 64 x (128 + 256) tokens, packed micro-batches of 8192 tokens; token counts / `--shrink`). Ranks
1 is the native TorchTrainer on one device, the reference; N > 1 is the FSDP2 trainer
(miles.trainer.fsdp) on N processes with NCCL (gloo on the CPU), each taking its token-balanced share.
Checked: every step's train/loss and train/grad_norm, and the fp32 weights after the last step,
within `--tol` of the reference (relative for metrics, absolute for weights; default 1e-4 in fp32,
the scale-out tests' bound, 5e-2 on the metrics only in bf16, whose gathers round differently).
Reported: median s / step over the steps after `--warmup`, tokens/s, tokens/s per device, MFU per
device (benchmarks/train_speed.py's F per token over `--peak-tflops` per device) and the scaling
efficiency, tokens/s over N x the reference's. Exit status 1 when a check fails.

broadcast: a trainer on device 0 and E native engines on devices 1..E in one process, the trainer's
weights broadcast to every engine by miles.transport.broadcast (NCCL; gloo on the CPU), the rollout
dtype bf16. Timed: the median of `--repeats` syncs after one warm-up, unchecked (the transport:
pack, broadcast, engine load) and checked (plus the SHA-256 on both sides). GB/s = the bf16 bytes
once over the seconds. Bound on an H200 host: NVLink 4 carries 450 GB/s per direction per GPU and a
broadcast delivers each byte to every receiver once, so bytes / 450 GB/s.

fleet: E processes, one native engine each on its own device (a router's fleet without the router),
the same `--prompts` split between them, `--new-tokens` per row exactly; all start together after
a warm-up (a barrier), wall clock = the slowest. Reported: rollout tokens/s and its ratio to E x the
one-engine figure.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from speculative import prompts  # noqa: E402
from train_speed import CASES, batch_flops, model_cfg, shrunk, synthetic_batch  # noqa: E402

from miles.config.schema import AlgoCfg, AlgoName, DType, PrecisionCfg, RolloutCfg, TrainerCfg  # noqa: E402
from miles.data.tokenizer import DEFAULT_ALPHABET  # noqa: E402
from miles.orchestrate.checkpoints import random_checkpoint  # noqa: E402

NVLINK_GBPS = 450.0  # H200 NVLink 4: 18 links x 25 GB/s per direction


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_of(args, rank: int) -> str:
    return f"cuda:{rank}" if args.device == "cuda" else "cpu"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def precision(dtype: str) -> PrecisionCfg:
    d = DType(dtype)
    return PrecisionCfg(name=dtype, train_dtype=d, rollout_dtype=DType.bf16 if d == DType.bf16 else d)


def checkpoint(name: str, work: str, seed: int = 0) -> str:
    return str(random_checkpoint(model_cfg(name), DEFAULT_ALPHABET, seed, Path(work) / name))


def check_devices(args, needed: int) -> None:
    if args.device == "cuda" and torch.cuda.device_count() < needed:
        raise SystemExit(f"needs {needed} GPUs, this host has {torch.cuda.device_count()}: pass fewer "
                         f"--ranks / --engines")


# -------------------------------------------------------------------------------------------- fsdp
def fsdp_rank(rank: int, world: int, port: int, ckpt: str, args, batch, out: str) -> None:
    """One rank's steps; rank 0 saves its metrics, step times and fp32 weights to `out`."""
    from miles.trainer.fsdp import FSDPTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    device = device_of(args, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    cfg = TrainerCfg(lr=1e-5, global_batch_size=batch.tokens.shape[0], pack_sequences=True,
                     max_tokens_per_micro_batch=args.max_tokens)
    common = dict(device=device, threads=args.threads, seed=0)
    if world == 1:
        trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), cfg, precision(args.dtype), **common)
    else:
        trainer = FSDPTrainer(rank, world, "127.0.0.1", port, ckpt, AlgoCfg(name=AlgoName.grpo), cfg,
                              precision(args.dtype), **common)
    metrics, times = [], []
    for _ in range(args.steps):
        sync(device)
        start = time.perf_counter()
        m = trainer.train_rl(batch)
        sync(device)
        times.append(time.perf_counter() - start)
        metrics.append({k: m[k] for k in ("train/loss", "train/grad_norm")})
    weights = trainer.parallel.policy_state(trainer.model) if world > 1 else {k: v.cpu() for k, v in trainer.model.state_dict().items()}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else None
    if rank == 0:
        torch.save(dict(metrics=metrics, times=times, weights=weights, peak_gb=peak), out)
    if world > 1:
        torch.distributed.destroy_process_group()


def fsdp(args) -> None:
    check_devices(args, max(args.ranks))
    case = CASES[0] if args.shrink == 1 else shrunk(CASES[0], args.shrink)
    args.max_tokens = case.max_tokens
    tol = args.tol if args.tol is not None else (1e-4 if args.dtype == "fp32" else 5e-2)
    rows, failed = [], False
    with tempfile.TemporaryDirectory() as work:
        ckpt = checkpoint(args.model, work)
        batch = synthetic_batch(case, json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"])
        tokens, flops = batch_flops(ckpt, batch)
        results = {}
        for world in args.ranks:
            out = f"{work}/ranks_{world}.pt"
            mp.spawn(fsdp_rank, args=(world, free_port(), ckpt, args, batch, out), nprocs=world)
            results[world] = torch.load(out)
            print(f"  {world} rank(s): {[round(t, 3) for t in results[world]['times']]} s", flush=True)
        ref = results[min(results)]
        ref_tps = None
        for world, r in results.items():
            seconds = statistics.median(r["times"][args.warmup:])
            tps = tokens / seconds
            ref_tps = ref_tps or tps
            metric_diff = max(abs(a[k] - b[k]) / max(1.0, abs(b[k]))
                              for a, b in zip(r["metrics"], ref["metrics"], strict=True) for k in b)
            weight_diff = max(float((r["weights"][k].double() - ref["weights"][k].double()).abs().max())
                              for k in ref["weights"])
            ok = metric_diff <= tol and (args.dtype != "fp32" or weight_diff <= tol)
            failed |= not ok
            rows.append(dict(ranks=world, seconds=seconds, tokens_per_s=tps, per_device=tps / world,
                             mfu=flops / seconds / (world * args.peak_tflops * 1e12), scaling=tps / (world * ref_tps),
                             metric_diff=metric_diff, weight_diff=weight_diff, peak_gb=r["peak_gb"], equal=ok))
    print(f"\ntrain_rl, {args.model}, {args.device}, {args.dtype}, {batch.tokens.shape[0]} samples x {batch.tokens.shape[1]}, "
          f"{tokens} tokens, {args.steps} steps (median of the last {args.steps - args.warmup}); "
          f"MFU per device of {args.peak_tflops:g} TFLOP/s; tolerance {tol:g}")
    print("| ranks | s / step | tokens/s | tokens/s per device | MFU per device | scaling | max metric diff "
          "| max weight diff | peak GB | equal |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
        print(f"| {r['ranks']} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | {r['per_device']:,.0f} | "
              f"{r['mfu']:.3g} | {r['scaling']:.2f} | {r['metric_diff']:.1e} | {r['weight_diff']:.1e} | {peak} | "
              f"{'yes' if r['equal'] else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if failed:
        raise SystemExit(f"a layout differs from {min(results)} rank(s) by more than {tol:g}")


# --------------------------------------------------------------------------------------- broadcast
def broadcast(args) -> None:
    from miles.orchestrate.handles import LocalHandle
    from miles.rollout.native import NativeEngine
    from miles.trainer.torch_trainer import TorchTrainer
    from miles.transport.broadcast import BroadcastWeightSync

    check_devices(args, 1 + max(args.engines))
    backend = "nccl" if args.device == "cuda" else "gloo"
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.models:
            ckpt = checkpoint(name, work)
            trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(), precision("bf16"),
                                   device=device_of(args, 0), threads=args.threads)
            for count in args.engines:
                engines = [NativeEngine(ckpt, RolloutCfg(max_running=8), DType.bf16,
                                        device=device_of(args, 1 + i), threads=args.threads) for i in range(count)]
                group = BroadcastWeightSync(LocalHandle(trainer), [LocalHandle(e) for e in engines], backend=backend,
                                            bucket_mb=args.bucket_mb, group_name=f"bench_{name}_{count}")
                nbytes = sum(b.nbytes for b in group.plan)  # what one sync sends
                seconds = {}
                for check in (False, True):
                    group.sync(check=check)  # warm-up: buffers, NCCL channels
                    seconds[check] = statistics.median(group.sync(check=check)[1] for _ in range(args.repeats))
                group.close()
                rows.append(dict(model=name, gb=nbytes / 1e9, engines=count, transport_s=seconds[False],
                                 checked_s=seconds[True], gbps=nbytes / 1e9 / seconds[False],
                                 bound_s=nbytes / 1e9 / NVLINK_GBPS))
                print(f"  {name} -> {count} engine(s): {seconds[False]:.3f} s, checked {seconds[True]:.3f} s", flush=True)
                del engines, group
            del trainer
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(f"\nweight broadcast ({backend}), bf16 rollout weights, buckets of {args.bucket_mb:g} MB")
    print("| model | GB | engines | s | GB/s | checked s | NVLink bound s | of the bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:  # the NVLink bound only where the bytes cross NVLink
        bound = (f"{r['bound_s']:.4f} | {r['bound_s'] / r['transport_s']:.0%}" if backend == "nccl" else "- | -")
        print(f"| {r['model']} | {r['gb']:.3g} | {r['engines']} | {r['transport_s']:.3f} | {r['gbps']:.3g} | "
              f"{r['checked_s']:.3f} | {bound} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


# ------------------------------------------------------------------------------------------- fleet
def fleet_rank(rank: int, world: int, ckpt: str, args, barrier, out: str) -> None:
    """One engine's share of the prompts; every rank saves its timed seconds to `out`.<rank>."""
    from miles.rollout.native import NativeEngine

    device = device_of(args, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    share = args.prompts // world
    texts = prompts(share, args.prompt_len + 1, seed=rank)  # prompt_len characters each
    cfg = RolloutCfg(max_new_tokens=args.new_tokens, max_prompt_len=args.prompt_len + 1,
                     max_running=share * args.samples)
    engine = NativeEngine(ckpt, cfg, DType(args.dtype), device=device, threads=args.threads, seed=rank)
    engine.stop_ids = torch.tensor([], dtype=torch.long, device=device)  # exactly new_tokens per row
    engine.generate(texts, ["?"] * share, n=args.samples)  # warm-up: kernels, CUDA graphs
    times = []
    for _ in range(args.repeats):
        barrier.wait()
        sync(device)
        start = time.perf_counter()
        engine.generate(texts, ["?"] * share, n=args.samples)
        sync(device)
        times.append(time.perf_counter() - start)
    torch.save(times, f"{out}.{rank}")


def fleet(args) -> None:
    check_devices(args, max(args.engines))
    ctx = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        ckpt = checkpoint(args.model, work)
        for world in args.engines:
            if args.prompts % world:
                raise SystemExit(f"--prompts {args.prompts} does not split over {world} engines")
            out = f"{work}/fleet_{world}"
            mp.spawn(fleet_rank, args=(world, ckpt, args, ctx.Barrier(world), out), nprocs=world)
            per_rank = [torch.load(f"{out}.{r}") for r in range(world)]
            wall = statistics.median(max(ts) for ts in zip(*per_rank))  # each repeat: the slowest engine
            tps = args.prompts * args.samples * args.new_tokens / wall
            rows.append(dict(engines=world, seconds=wall, tokens_per_s=tps))
            print(f"  {world} engine(s): {wall:.3f} s", flush=True)
    one = rows[0]["tokens_per_s"] / rows[0]["engines"]
    print(f"\nrollout, {args.model}, {args.dtype}, {args.prompts} prompts x {args.samples} samples x "
          f"{args.new_tokens} tokens, prompts of {args.prompt_len}")
    print("| engines | s | tokens/s | scaling |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['engines']} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s'] / (r['engines'] * one):.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("fsdp", "broadcast", "fleet"):
        s = sub.add_parser(name)
        s.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
        s.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
        s.add_argument("--json")
        if name != "fsdp":
            s.add_argument("--repeats", type=int, default=3)
        if name != "broadcast":  # broadcast: --models, bf16
            s.add_argument("--model", default="qwen3_tiny")
            s.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    f = sub.choices["fsdp"]
    f.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="1 first: the reference")
    f.add_argument("--steps", type=int, default=5)
    f.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    f.add_argument("--shrink", type=int, default=None, help="divide token counts (default: 8 cpu, 1 cuda)")
    f.add_argument("--tol", type=float, default=None)
    f.add_argument("--peak-tflops", type=float, default=989.0, help="per device (H100/H200 dense bf16)")
    b = sub.choices["broadcast"]
    b.add_argument("--engines", type=int, nargs="+", default=[1])
    b.add_argument("--models", nargs="+", default=["qwen3_tiny"])
    b.add_argument("--bucket-mb", type=float, default=64.0)
    r = sub.choices["fleet"]
    r.add_argument("--engines", type=int, nargs="+", default=[1, 2], help="1 first: the reference")
    r.add_argument("--prompts", type=int, default=16)
    r.add_argument("--samples", type=int, default=8)
    r.add_argument("--prompt-len", type=int, default=16)
    r.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    if args.mode == "fsdp":
        if args.ranks[0] != 1:
            raise SystemExit("--ranks must start with 1, the one-device reference")
        args.shrink = args.shrink or (1 if args.device == "cuda" else 8)
        args.warmup = min(args.warmup, args.steps - 1)
    if args.mode == "fleet" and args.engines[0] != 1:
        raise SystemExit("--engines must start with 1, the one-engine reference")
    {"fsdp": fsdp, "broadcast": broadcast, "fleet": fleet}[args.mode](args)


if __name__ == "__main__":
    main()
