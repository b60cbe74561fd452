"""The Megatron-core trainer on the CPU (`make test`'s Megatron pass; docs/megatron.md, "Tests").

`make test` installs megatron-core 0.19.2 into $(VENV)/megatron-core (pip --target: the wheel says
Python >= 3.12, and its Python code runs on 3.11; only its dataset helpers are compiled, unused here)
and runs this directory with that folder on PYTHONPATH, in a pytest process of its own (Megatron's
parallel state and the CUDA-to-CPU mapping are process-wide). Without megatron-core nothing here is
collected. CUDA is what these tests mock (tests/megatron/cuda_on_cpu.py); tests/gpu runs the same
trainer on the H200 without the mapping."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
collect_ignore_glob = [] if HAS_MEGATRON else ["test_*.py"]
if HAS_MEGATRON:
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent), str(here.parent / "gpu")]  # cuda_on_cpu, the contract suite, the H200 tier's helpers


@pytest.fixture(scope="session", autouse=True)
def megatron_on_this_device():
    """On a CPU machine every test here runs with CUDA mapped to the CPU; on CUDA, as it is."""
    if torch.cuda.is_available():
        yield "cuda"
        return
    from cuda_on_cpu import cuda_on_cpu

    with cuda_on_cpu():
        yield "cpu"
