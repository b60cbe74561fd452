"""The fused W4A16 kernel against int4_linear, on the CPU through the Triton interpreter.

The interpreter has to be switched on before triton is first imported (triton.language's own jit
helpers are made then), and other test modules import it earlier through miles.precision; so on a
CPU machine one test re-runs this file in a subprocess with TRITON_INTERPRET=1, where the kernel tests
run (numpy), and skips them in this process. Where triton is not installed they skip and only the
dispatcher's fallback is checked. On a CUDA machine the same small cases run compiled on the GPU
(tests/gpu/test_int4_triton_cuda.py has the real shapes).
"""

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import NoSplitKReduction, run_under_interpreter

from miles.precision import dequantize_int4, int4_linear, pack_int4, quantize_int4
from miles.precision import int4_triton as it

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHILD = os.environ.get("TRITON_INTERPRET") == "1"  # the subprocess that test_kernels_under_interpreter starts
RUNS_KERNEL = it.triton_available() and (DEV == "cuda" or (CHILD and it._interpreting()))
needs_kernel = pytest.mark.skipif(not RUNS_KERNEL, reason="kernel tests run on CUDA or in the interpreter subprocess")


@pytest.mark.skipif(DEV != "cpu" or CHILD or not it.triton_available(), reason="only the CPU parent starts it")
def test_kernels_under_interpreter():
    run_under_interpreter(__file__)


def _operands(n, k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-6, 6, (n, 1), generator=g).float())
    q, s = quantize_int4(w, group)
    return pack_int4(q).to(DEV), s.to(DEV)


def _rel(a, ref):
    return ((a.float() - ref).norm() / ref.norm()).item()


# Edges: M, N below / across tiles; odd K; K not a multiple of the group; a K tail inside one tile.
CASES = [(1, 64, 256, 128), (3, 70, 257, 32), (17, 96, 300, 128), (5, 33, 200, 32), (2, 8, 5, 32)]
# Default (join unpack, swapped dot), forced split-K, shift unpack with one group per tile, and shift
# unpack with BK > group (scales gathered per element) through the unswapped dot with split-K.
CONFIGS = [None, it.TileConfig(16, 64, 64, 3, 4, 2), it.TileConfig(16, 32, 32, 1, 4, 2, unpack=1),
           it.TileConfig(32, 64, 128, 2, 4, 2, unpack=1, swap=False)]
IDS = ["heuristic", "split3", "shift-unpack", "shift-noswap-split2"]


@needs_kernel
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("m,n,k,group", CASES)
def test_matches_int4_linear(m, n, k, group, config):
    packed, scales = _operands(n, k, group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEV)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
    wq = dequantize_int4(packed, scales, group, k=k, dtype=torch.bfloat16).float()
    for b in (None, bias):
        y = it.int4_linear_fused(x, packed, scales, group, b, config=config)
        ref4 = int4_linear(x, packed, scales, group, b)
        ref = F.linear(x.float(), wq, None if b is None else b.float())
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert _rel(y, ref4.float()) < 1e-2
        # Only the fp32 summation order differs: as close to the fp32 result as int4_linear is.
        assert _rel(y, ref) <= 1.25 * _rel(ref4, ref) + 1e-4


@needs_kernel
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("group", [32, 128])
def test_weight_bits_exact_through_identity(group, config):
    # x = I: each output is one product w[n, k] * 1 plus exact zeros, i.e. the weight value the kernel
    # multiplied, which must be dequantize_int4's bf16 bits (fp32 q * scale, rounded to nearest even once).
    n, k = 40, 161
    packed, scales = _operands(n, k, group, seed=3)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEV)
    y = it.int4_linear_fused(eye, packed, scales, group, config=config)
    assert torch.equal(y, dequantize_int4(packed, scales, group, k=k, dtype=torch.bfloat16).T)


@needs_kernel
def test_fp16_and_leading_dims():
    packed, scales = _operands(48, 130, 32)
    x = torch.randn(2, 3, 130).to(torch.float16).to(DEV)
    y = it.int4_linear_fused(x, packed, scales, 32)
    ref = int4_linear(x, packed, scales, 32)
    assert y.shape == (2, 3, 48) and y.dtype == torch.float16
    assert _rel(y, ref.float()) < 1e-2


def test_refuses_what_it_does_not_handle():
    packed, scales = _operands(16, 64, 32)
    x = torch.randn(2, 64, device=DEV)
    assert it.fused_supported(x, packed, scales, 32) is not None  # fp32 activations
    assert it.fused_supported(x.bfloat16(), packed, scales, 128) is not None  # scales do not fit group 128
    assert it.fused_supported(x.bfloat16()[:, :61], packed, scales, 32) is not None  # K does not fit
    with pytest.raises(ValueError):
        it.int4_linear_fused(x, packed, scales, 32)


def test_split_heuristic_fills_the_gpu_for_decode_only():
    # M = 1 on a 2560 x 9728 layer: 40 output tiles alone would leave most of 132 SMs idle.
    cfg = it.pick_config(1, 2560, 9728, 132)
    assert cfg.split_k > 1 and -(-2560 // cfg.block_n) * cfg.split_k >= 132
    small = it.pick_config(1, 1024, 1024, 132)  # capped by the K tiles: no empty slices
    assert 1 < small.split_k <= -(-1024 // small.block_k)
    assert it.pick_config(1, 9728, 2560, 132).split_k == 1  # 152 tiles already fill the GPU
    assert it.pick_config(4096, 2560, 9728, 132).split_k == 1


def test_unsplit_decode_tiles_go_128_deep():
    # 64 rows of the 19456-wide gate_up: 304 output tiles fill 132 SMs, and the H100 sweep liked
    # BK 128 x 3 stages there (1.05x bf16 against 0.88x at BK 256)
    assert it.pick_config(64, 19456, 2560, 132) == it.TileConfig(64, 64, 128, 1, 4, 3)
    assert it.pick_config(64, 2560, 9728, 132).block_k == 256  # split: one K tile per slice stays
    assert it.pick_config(16, 19456, 2560, 132) == it.TileConfig(16, 64, 256, 1, 4, 3)


@needs_kernel
def test_split_k_off_runs_one_k_slice(monkeypatch):
    """SPLIT_K = False (mismatch_sources.py --w4a16-kernel unsplit): the heuristic's tiles in one K
    slice, no reduction, the same output as that config given explicitly."""
    packed, scales = _operands(64, 512, 128)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEV)
    heuristic = it.pick_config(1, 64, 512, it._sm_count(None if DEV == "cpu" else 0))
    assert heuristic.split_k > 1
    want = it.int4_linear_fused(x, packed, scales, 128, config=replace(heuristic, split_k=1))
    monkeypatch.setattr(it, "SPLIT_K", False)
    monkeypatch.setattr(it, "_splitk_reduce_kernel", NoSplitKReduction())
    assert torch.equal(it.int4_linear_fused(x, packed, scales, 128), want)


def test_auto_falls_back_to_int4_linear_bitwise_on_cpu():
    packed, scales = _operands(24, 96, 32)
    packed, scales = packed.cpu(), scales.cpu()
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(3, 96).to(dtype)
        bias = torch.randn(24).to(dtype)
        assert torch.equal(it.int4_linear_auto(x, packed, scales, 32, bias), int4_linear(x, packed, scales, 32, bias))
