"""One training linear's forward + backward per precision path, at the Qwen3-4B shape's layers.

    python3 benchmarks/fp8_backward_speed.py                 # CUDA; --tokens 4096 8192 by default

Paths (x [M, K] bf16, the master weight W [N, K] fp32, an output gradient [M, N] bf16):
  bf16            F.linear(x, W in bf16): what precision=bf16 multiplies (the cast once, outside the timing)
  w8a16           fp8's default: F.linear(x, the dequantized FP8 weight), backward in bf16
  w8a16 fp8-bwd   the same forward, dgrad and wgrad in FP8 (precision.fp8_backward=fp8)
  w8a8            FP8 x FP8 forward (scaled_mm), backward in bf16
  w8a8 fp8-bwd    FP8 forward and backward
The weight's FP8 products are made once (as once per optimizer step in training), outside the timing.
Timing: CUDA events, every path run once before any is timed, then the median of --repeats.
FLOPs: 6 M N K (forward, dgrad, wgrad); the peak in the table is --peak-tflops (989: H100 / H200 bf16 dense).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from miles.precision.fp8_backward import probe_report
from miles.precision.fp8_train import FP8WeightCache, fp8_train_linear, straight_through_dequantized, w8a16_train_linear

LAYERS = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}


def paths(w: torch.Tensor, w16: torch.Tensor, cache: FP8WeightCache) -> dict:
    bf16 = torch.bfloat16
    return {
        "bf16": lambda x: F.linear(x, w16),
        "w8a16": lambda x: F.linear(x, straight_through_dequantized(w, cache, bf16)),
        "w8a16 fp8-bwd": lambda x: w8a16_train_linear(x, w, None, cache, bf16),
        "w8a8": lambda x: fp8_train_linear(x, w, None, cache),
        "w8a8 fp8-bwd": lambda x: fp8_train_linear(x, w, None, cache, fp8_backward=True),
    }


def time_call(fn, x, grad, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x).backward(grad)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark times CUDA kernels")
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; FP8 backward: {probe_report(dev)}\n")
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for layer, (n, k) in LAYERS.items():
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).requires_grad_(True)
        w16 = w.detach().to(torch.bfloat16).requires_grad_(True)
        cache = FP8WeightCache()
        for m in args.tokens:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_(True)
            grad = torch.randn(m, n, device=dev, generator=gen, dtype=torch.bfloat16) * 1e-3
            cases.append((layer, m, n, k, x, grad, paths(w, w16, cache)))
    for *_, x, grad, fns in cases:  # first calls (kernel selection, Triton compiles, the weight's products)
        for fn in fns.values():
            fn(x).backward(grad)
    torch.cuda.synchronize()
    names = list(cases[0][-1])
    print("| layer (N x K) | tokens | " + " | ".join(f"{n} ms" for n in names) + " | bf16 / (w8a16 fp8-bwd) | "
          "best TFLOP/s (% of peak) |")
    print("|---|---:|" + "---:|" * (len(names) + 2))
    for layer, m, n, k, x, grad, fns in cases:
        ms = {name: time_call(fn, x, grad, args.repeats) for name, fn in fns.items()}
        best = min(ms.values())
        tflops = 6 * m * n * k / best / 1e12
        print(f"| {layer} ({n} x {k}) | {m} | " + " | ".join(f"{ms[name] * 1e3:.3f}" for name in names) +
              f" | {ms['bf16'] / ms['w8a16 fp8-bwd']:.2f}x | {tflops:.0f} ({tflops / args.peak_tflops:.0%}) |",
              flush=True)


if __name__ == "__main__":
    main()
