"""The trainer's MoE experts, forward + backward: the expert loop against the two grouped GEMMs
(miles.models.moe.grouped_swiglu, torch._grouped_mm), side by side in one run.

    python3 benchmarks/moe_train_speed.py [--tokens 2048 8192] [--experts 128 --topk 8 --hidden 2048 --width 768]

One MoE layer of Qwen3-30B-A3B's width by default (128 experts, 8 a token, hidden 2048, expert width
768), as the trainer runs it: fp32 master stacks under bf16 autocast, random routing, forward and
backward of every stack and the input. Per token count, the median of --repeats timed calls after 2
warm-ups, every shape and path having run once first (CUDA events, synchronised), and the achieved
TFLOP/s of the expert GEMMs: a token's forward is 2 * 3 * hidden * width flops per chosen expert
(gate, up, down), the backward twice that. The compute roofline is the card's dense bf16 peak
(--peak-tflops, an H100 / H200 SXM's 989 by default). Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from miles.models import moe  # noqa: E402
from miles.models.moe import Experts  # noqa: E402


def time_step(experts: Experts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, repeats: int) -> float:
    """Median seconds of one forward + backward."""
    def step():
        experts.zero_grad(set_to_none=True)
        xg = x.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = experts(xg, chosen, weights)
        out.float().square().mean().backward()

    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args()
    torch.manual_seed(0)
    experts = Experts(args.experts, args.hidden, args.width).cuda()
    experts.init_weights(None)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.experts} experts, top-{args.topk}, "
          f"hidden {args.hidden}, width {args.width}; fp32 masters under bf16 autocast, forward + backward")
    print("| tokens | loop s | grouped s | grouped / loop speed | loop TFLOP/s | grouped TFLOP/s | grouped % of peak |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    inputs = {tokens: (torch.randn(tokens, args.hidden, device="cuda"),
                       torch.rand(tokens, args.experts, device="cuda").topk(args.topk, dim=-1).indices,
                       torch.rand(tokens, args.topk, device="cuda")) for tokens in args.tokens}
    paths = {"loop": (), "grouped": ("cuda",)}
    # Every shape and path once before any timing: on 2026-12-07 the loop's first shape timed slower
    # than a 4x larger one after its own 2 warm-ups (first-call costs not yet paid).
    for devices in paths.values():
        moe.GROUPED_GEMM_DEVICES = devices
        for x, chosen, weights in inputs.values():
            time_step(experts, x, chosen, weights, 1)
    for tokens, (x, chosen, weights) in inputs.items():
        seconds = {}
        for name, devices in paths.items():
            moe.GROUPED_GEMM_DEVICES = devices
            seconds[name] = time_step(experts, x, chosen, weights, args.repeats)
        flops = 3 * 2 * 3 * args.hidden * args.width * tokens * args.topk  # forward + 2x backward
        tflops = {name: flops / s / 1e12 for name, s in seconds.items()}
        print(f"| {tokens} | {seconds['loop']:.4f} | {seconds['grouped']:.4f} | "
              f"{seconds['loop'] / seconds['grouped']:.2f}x | {tflops['loop']:.0f} | {tflops['grouped']:.0f} | "
              f"{100 * tflops['grouped'] / args.peak_tflops:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
