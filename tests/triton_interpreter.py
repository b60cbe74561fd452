"""Triton kernels on a CPU machine: a test file runs itself again in a subprocess with TRITON_INTERPRET=1
(triton picks interpreting or compiling when it is imported, so the switch needs a fresh process)."""

import os
import subprocess
import sys


def run_under_interpreter(test_file: str) -> None:
    """Run `test_file`'s tests under the Triton interpreter; fail with their output unless they pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]


class NoSplitKReduction:
    """Stands in for a kernel module's `_splitk_reduce_kernel` (monkeypatched): launching it fails."""

    def __getitem__(self, grid):
        raise AssertionError("split-K reduction launched")
