"""What the Triton kernels in miles/ compile to on Hopper, read on the CPU: no GPU time.

    .venv/bin/python benchmarks/kernel_sass.py [PATTERN] [--top 16]

PATTERN (a regex, default `_gate_up_kernel|_down_kernel`) picks launches of
tests/unit/test_triton_compile_hopper.py's cases (every kernel as its launcher launches it) by their
id (kernel name, argument types, constexprs). Each is compiled for sm_90 with Triton's ptxas and
disassembled with Triton's nvdisasm; the table gives its registers, stack (local memory) and shared
memory bytes (cuobjdump's resource usage), and the SASS instructions it holds, by opcode, most
common first. Static counts, not executed ones: a loop body counts once (as unrolled and pipelined),
so they show which instructions a kernel leans on (conversions such as I2FP / F2FP run at a quarter
of the FP32 rate or less on Hopper; STL / LDL are local memory), not time. Needs triton, not CUDA.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit")]  # the checkout, and the launch cases

import triton  # noqa: E402

import test_triton_compile_hopper as cases  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.M)
RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def compiled(launch) -> bytes:
    return triton.compile(launch.source(), target=cases.HOPPER, options=dict(launch.options)).asm["cubin"]


def inspect(cubin: bytes) -> tuple[dict[str, int], collections.Counter]:
    """(registers / stack / shared / local bytes, SASS opcode counts) of one compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        usage = subprocess.run([TOOLS / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([TOOLS / "nvdisasm", "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    reg, stack, shared, local = map(int, RESOURCES.search(usage).groups())
    return dict(registers=reg, stack=stack, shared=shared, local=local), collections.Counter(OPCODE.findall(sass))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pattern", nargs="?", default=r"_gate_up_kernel|_down_kernel")
    parser.add_argument("--top", type=int, default=16, help="opcodes shown per kernel")
    args = parser.parse_args()
    chosen = [launch for launch in cases.LAUNCHES if re.search(args.pattern, launch.id)]
    if not chosen:
        sys.exit(f"no launch id matches {args.pattern!r}; ids look like {cases.LAUNCHES[0].id!r}")
    print("| launch | registers | stack B | shared B | instructions | most common |")
    print("|---|---:|---:|---:|---:|---|")
    for launch in chosen:
        usage, ops = inspect(compiled(launch))
        common = " ".join(f"{op} {n}" for op, n in ops.most_common(args.top))
        print(f"| {launch.id} | {usage['registers']} | {usage['stack']} | {usage['shared']} | {sum(ops.values())} "
              f"| {common} |", flush=True)


if __name__ == "__main__":
    main()
