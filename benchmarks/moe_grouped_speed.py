"""The grouped MoE expert kernels (miles/models/moe_grouped.py) per stack format, against the memory roofline.

    python3 benchmarks/moe_grouped_speed.py [--rows 1 8 64 256] [--experts 128 --topk 8 --hidden 2048 --width 768]
    python3 benchmarks/moe_grouped_speed.py --alt candidate/moe_grouped.py   # a candidate file, side by side

One MoE layer of Qwen3-30B-A3B's width by default (128 experts, 8 a token, hidden 2048, expert width
768): random bf16 experts, and the FP8 / INT4 payloads weight sync makes of them (held so by the FP8 /
INT4 engines, miles/models/quant_experts.py). Per row count, each format's `grouped_experts` call is
graph-timed (kernel_sweep.py's `_time_graph`: no launch overhead) at K tiles of 128 (the default) and
64, its output checked against the same kernels on the dequantized stacks (bits equal: "exact"), and
set against the roofline of the bytes it must read: every expert some token chose, once, in the
format held (bf16 2 bytes a weight; FP8 1 + a fp32 scale per 128 x 128 block; INT4 1/2 + a fp32 scale
per group of 128), over the measured device-to-device copy bandwidth. Last, the compiled kernels per format (registers, spills,
shared memory, mma.sync or wgmma), which say why a format runs as it does. `--alt FILE` loads a
second copy of the kernels module from FILE (another branch's moe_grouped.py, say) and times its
variants in the same run, on the same inputs, under the label "alt". Needs CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kernel_sweep import _time_graph  # noqa: E402
from rollout_gpu import copy_bandwidth  # noqa: E402

from miles.models import moe_grouped as mg  # noqa: E402
from miles.precision.rollout_format import from_rollout_format, rollout_format  # noqa: E402

FORMATS = ("bf16", "fp8", "int4")
# grouped_experts' keywords per variant: its default K tile (128) and 64.
VARIANTS = {"BK 128": {}, "BK 64": {"block_k": 64}}


def stacks(e: int, h: int, i: int) -> dict[str, tuple]:
    """format -> (gate_up, down) operands, the quantized ones with the dense stacks they dequantize to."""
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {"gate_up_proj": 0.02 * torch.randn(e, 2 * i, h, device="cuda", generator=g),
               "down_proj": 0.02 * torch.randn(e, h, i, device="cuda", generator=g)}
    out = {"bf16": tuple(w.to(torch.bfloat16) for w in weights.values())}
    for fmt in ("fp8", "int4"):
        payload = rollout_format(weights, fmt, lambda _: False)
        dense = from_rollout_format(payload, fmt, torch.bfloat16)
        if fmt == "fp8":
            quant = tuple(mg.Stack(payload[n], payload[n + "_scale_inv"], "fp8") for n in weights)
        else:
            quant = tuple(mg.Stack(payload[n + "_packed"], payload[n + "_scale"], "int4", 128) for n in weights)
        out[fmt] = quant, tuple(dense[n] for n in weights)
    del weights
    return out


@contextmanager
def compiled_kernels():
    """{kernel name: its compiled form} of the Triton launches inside the block (JITFunction.run returns it)."""
    seen, run = {}, JITFunction.run

    def recording(self, *args, **kwargs):
        kernel = run(self, *args, **kwargs)
        seen[self.fn.__name__] = kernel
        return kernel

    JITFunction.run = recording
    try:
        yield seen
    finally:
        JITFunction.run = run


def kernel_facts(kernel) -> str:
    ptx = kernel.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "no mma"
    return (f"{kernel.n_regs} | {kernel.n_spills} | {kernel.metadata.shared / 1024:.1f} | {mma} "
            f"| {kernel.metadata.num_warps} | {kernel.metadata.num_stages}")


def held_operands(module, ops: dict, fmt: str) -> tuple:
    """`fmt`'s (gate_up, down) as `module`'s grouped_experts takes them (its own Stack type)."""
    operands = ops[fmt] if fmt == "bf16" else ops[fmt][0]
    return tuple(module.Stack(*o) if isinstance(o, mg.Stack) else o for o in operands)


def load_alt(path: str):
    """A second copy of the kernels module from `path` (its own Triton kernels, compiled beside ours)."""
    spec = importlib.util.spec_from_file_location("moe_grouped_alt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bytes_per_weight(fmt: str) -> float:
    return {"bf16": 2.0, "fp8": 1 + 4 / 128**2, "int4": 0.5 + 4 / 128}[fmt]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--alt", help="another moe_grouped.py to time beside this checkout's")
    args = parser.parse_args()
    modules = {"": mg} | ({"alt ": load_alt(args.alt)} if args.alt else {})
    e, k, h, i = args.experts, args.topk, args.hidden, args.width
    bandwidth = copy_bandwidth()
    ops = stacks(e, h, i)
    print(f"{e} experts, top-{k}, hidden {h}, width {i}; copy bandwidth {bandwidth / 1e12:.2f} TB/s\n")
    print("| rows | experts read | format | K tile | us | vs bf16 | % of roofline | bits vs dequantized |")
    print("|---:|---:|---|---|---:|---:|---:|---|")
    g = torch.Generator(device="cuda").manual_seed(1)
    for rows in args.rows:
        x = torch.randn(rows, h, device="cuda", generator=g).to(torch.bfloat16)
        chosen = torch.rand(rows, e, device="cuda", generator=g).topk(k, dim=-1).indices
        route = torch.rand(rows, k, device="cuda", generator=g)
        active = chosen.unique().numel()
        base = None
        for fmt in FORMATS:
            for (label, m), (variant, kw) in ((mod, var) for mod in modules.items() for var in VARIANTS.items()):
                operands = held_operands(m, ops, fmt)
                ms = _time_graph(lambda: m.grouped_experts(x, chosen, route, *operands, **kw))
                out = m.grouped_experts(x, chosen, route, *operands, **kw)
                bits = "-"
                if fmt != "bf16":  # the same kernels on the dequantized stacks
                    ref = m.grouped_experts(x, chosen, route, *ops[fmt][1], **kw)
                    bits = "exact" if torch.equal(out, ref) else f"{(out != ref).sum().item()} off"
                base = base or ms
                roofline_ms = active * 3 * h * i * bytes_per_weight(fmt) / bandwidth * 1e3
                print(f"| {rows} | {active} | {fmt} | {label}{variant} | {ms * 1e3:,.1f} | {base / ms:.2f}x "
                      f"| {100 * roofline_ms / ms:.1f}% | {bits} |", flush=True)
    print("\n| format | K tile | kernel | registers | spills | shared KB | MMA | warps | stages |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|")
    for fmt in FORMATS:
        for (label, m), (variant, kw) in ((mod, var) for mod in modules.items() for var in VARIANTS.items()):
            with compiled_kernels() as seen:
                m.grouped_experts(x, chosen, route, *held_operands(m, ops, fmt), **kw)
            for name, kernel in seen.items():
                print(f"| {fmt} | {label}{variant} | {name} | {kernel_facts(kernel)} |", flush=True)


if __name__ == "__main__":
    main()
