"""Weight sync time per model size, trainer -> engine in one process (the colocated case).

    python benchmarks/weight_sync.py --device cuda [--models qwen3_0_6b qwen3_1_7b qwen3_4b qwen3_8b]
    .venv/bin/python benchmarks/weight_sync.py --device cpu --models qwen3_tiny

Both sides hold random weights of a conf/model shape: the trainer fp32 master weights, the engine
bf16 (the bf16 recipe). Timed, each the median of --repeats after a warm-up, synchronised:
  flat      what `sync_weights` does in-process: TorchTrainer.get_weights(in_process=True) casts the
            master weights into its flat bf16 buffer (one foreach copy) and checksums it on the device;
            NativeEngine.update_weights copies the buffer into the engine's own and checksums that
  host      the object-store path (what Ray actors do): bf16 state dict copied to the host, SHA-256 on
            both sides, load_state_dict back to the device (only for models up to --host-max-gb)
Bound: the flat path moves fp32 reads (4 B) + bf16 writes (2 B) for the cast, then 2 + 2 B for the
copy and 2 x 2 B of checksum reads per parameter: 14 B x N over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import yaml

from miles.models import CausalLM
from miles.models.config import ArchConfig
from miles.transport.checksum import checksum, to_dtype
from miles.transport.flat import FlatLayout, FlatWeights

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def arch(name: str) -> ArchConfig:
    values = {k: v for k, v in yaml.safe_load((CONF / f"{name}.yaml").read_text()).items()
              if k not in ("name", "hf_checkpoint")}
    return ArchConfig(**{**values, "vocab_size": values.get("vocab_size") or 64})


def timed(fn, device: str, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, device: str, repeats: int, host_max_gb: float) -> dict:
    with torch.device(device):
        trainer = CausalLM(arch(name))  # fp32 master weights
        engine = CausalLM(arch(name)).to(torch.bfloat16)
    numel = sum(p.numel() for p in trainer.parameters())
    engine_flat = FlatWeights.adopt(engine)
    sync = FlatWeights.like(FlatLayout.of(trainer.state_dict(), torch.bfloat16), device)

    def flat():
        sync.fill_from(trainer.state_dict())
        digest = sync.checksum()
        engine_flat.copy_from(sync)
        assert engine_flat.checksum() == digest

    result = {"model": name, "params": numel, "gb": numel * 2 / 1e9, "flat_s": timed(flat, device, repeats)}
    if result["gb"] <= host_max_gb:
        def host():
            weights = to_dtype(trainer.state_dict(), "bf16")
            digest = checksum(weights)
            engine.load_state_dict(weights)
            assert checksum(engine.state_dict()) == digest

        result["host_s"] = timed(host, device, max(1, repeats // 5))
    del trainer, engine, engine_flat, sync
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def bandwidth(device: str) -> float:
    if device != "cuda":
        return float("nan")
    src = torch.empty(int(2e9), dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), "cuda", 5)
    return 2 * src.numel() * 2 / ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--models", nargs="+", default=["qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen3_8b"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--host-max-gb", type=float, default=1.5, help="host path only up to this bf16 size")
    args = parser.parse_args()
    bw = bandwidth(args.device)
    rows = [measure(m, args.device, args.repeats, args.host_max_gb) for m in args.models]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s\n")
    print("| model | params | bf16 GB | flat sync ms (incl. checks) | bound ms (14 B/param) | host path s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        host = f"{r['host_s']:.2f}" if "host_s" in r else "-"
        print(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['gb']:.2f} | {r['flat_s'] * 1e3:.1f} "
              f"| {14 * r['params'] / bw * 1e3:.1f} | {host} |")


if __name__ == "__main__":
    main()
