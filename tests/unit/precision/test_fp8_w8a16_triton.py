"""The fused FP8 W8A16 kernel against F.linear on the dequantized weight, on the CPU through the
Triton interpreter (a subprocess with TRITON_INTERPRET=1, as test_int4_triton.py explains); on a CUDA
machine the same cases run compiled (tests/gpu/test_fp8_w8a16_cuda.py has the real shapes)."""

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import NoSplitKReduction, run_under_interpreter

from miles.precision import fp8_w8a16_triton as wt
from miles.precision.fp8 import FP8_DTYPE, dequantize_fp8_weight, quantize_fp8_weight
from miles.precision.int4_triton import TileConfig, pick_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHILD = os.environ.get("TRITON_INTERPRET") == "1"
RUNS_KERNEL = wt.triton_available() and (DEV == "cuda" or (CHILD and wt._interpreting()))
needs_kernel = pytest.mark.skipif(not RUNS_KERNEL, reason="kernel tests run on CUDA or in the interpreter subprocess")


@pytest.mark.skipif(DEV != "cpu" or CHILD or not wt.triton_available(), reason="only the CPU parent starts it")
def test_kernels_under_interpreter():
    run_under_interpreter(__file__)


def _operands(n, k, seed=0):
    """Blocks of very different magnitudes (scales 2^-8..2^8), and subnormal and negative codes."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-8, 9, (-(-n // 128), 1), generator=g).float()).repeat_interleave(128, 0)[:n]
    w = torch.randn(n, k, generator=g) * rows
    w[0, : min(k, 8)] = torch.tensor([1e-4, -3e-4, 0.0, -0.0, 448.0, -448.0, 2.0 ** -9, 7.0])[: min(k, 8)] * rows[0]
    q, s = quantize_fp8_weight(w)
    return q.to(DEV), s.to(DEV)


def _rel(a, ref):
    return ((a.float() - ref).norm() / ref.norm()).item()


# Edges: M, N below / across tiles and scale blocks; K not a multiple of 128; a K tail inside a tile.
CASES = [(1, 64, 256), (3, 200, 257), (17, 96, 300), (5, 33, 130), (2, 8, 5)]
# Heuristic; forced split-K with BK < 128; BK > 128 (two scale blocks a tile) through the unswapped dot;
# BK = 128 with tiles narrower than a block (one scale a tile: SCALAR_SCALE); the 65-256-row choice for
# narrow layers (a block-wide tile, two scale blocks deep, 8 warps, one K slice).
CONFIGS = [None, TileConfig(16, 64, 64, 3, 4, 2), TileConfig(32, 64, 256, 2, 4, 2, swap=False),
           TileConfig(16, 32, 128, 2, 4, 3), TileConfig(64, 128, 256, 1, 8, 4)]
IDS = ["heuristic", "split3-bk64", "bk256-noswap-split2", "scalar-scale-bn32-split2", "bn128-bk256-one-slice"]


@needs_kernel
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("m,n,k", CASES)
def test_matches_linear_on_dequantized_weight(m, n, k, config):
    q, s = _operands(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEV)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
    wd = dequantize_fp8_weight(q, s, torch.bfloat16).float()
    for b in (None, bias):
        y = wt.w8a16_linear_fused(x, q, s, b, config=config)
        ref16 = wt.w8a16_linear(x, q, s, b)
        ref = F.linear(x.float(), wd, None if b is None else b.float())
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert _rel(y, ref16.float()) < 1e-2
        # Only the fp32 summation order differs: as close to the fp32 result as the bf16 F.linear is.
        assert _rel(y, ref) <= 1.25 * _rel(ref16, ref) + 1e-4


@needs_kernel
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_weight_bits_exact_through_identity(config):
    # x = I: each output is one product w[n, k] * 1 plus exact zeros: the weight value the kernel
    # multiplied, which must be dequantize_fp8_weight's bf16 bits (fp32 q * scale, rounded once).
    n, k = 160, 261
    q, s = _operands(n, k, seed=3)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEV)
    y = wt.w8a16_linear_fused(eye, q, s, config=config)
    assert torch.equal(y, dequantize_fp8_weight(q, s, torch.bfloat16).T)


@needs_kernel
def test_every_e4m3_code_decodes_exactly():
    # All 254 finite codes (the quantizer never writes 0x7F / 0xFF, NaN) in one row, scale 1.
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    q = codes.view(FP8_DTYPE).reshape(1, -1).to(DEV)
    s = torch.ones(1, 2, device=DEV)
    eye = torch.eye(q.shape[1], dtype=torch.bfloat16, device=DEV)
    y = wt.w8a16_linear_fused(eye, q, s)
    assert torch.equal(y.T, q.to(torch.float32).to(torch.bfloat16))


@needs_kernel
def test_fp16_and_leading_dims():
    q, s = _operands(48, 130)
    x = torch.randn(2, 3, 130).to(torch.float16).to(DEV)
    y = wt.w8a16_linear_fused(x, q, s)
    assert y.shape == (2, 3, 48) and y.dtype == torch.float16
    assert _rel(y, wt.w8a16_linear(x, q, s).float()) < 1e-2


def test_decode_tiles_stay_64_wide_and_go_deeper_where_sms_idle():
    """The H100 sweeps' choices (pick_w8a16_config's docstring): tiles >= 64 wide (narrower ones left
    the prefill GEMM's bits), 256 deep and 32 rows where 64 x 64 tiles leave SMs idle."""
    for m in (17, 32, 64):
        assert wt.pick_w8a16_config(m, 19456, 2560) == TileConfig(32 if m <= 32 else 64, 64, 128, 1, 4, 3)
        assert wt.pick_w8a16_config(m, 6144, 2560) == TileConfig(32 if m <= 32 else 64, 64, 256, 1, 4, 3)
        # 40 tiles of 64 columns: 32-row tiles, or most SMs would idle
        assert wt.pick_w8a16_config(m, 2560, 9728) == TileConfig(32, 64, 256, 1, 4, 3)
    for m in (65, 128, 256):
        assert wt.pick_w8a16_config(m, 2560, 4096) == TileConfig(64, 128, 256, 1, 8, 4)
        assert wt.pick_w8a16_config(m, 19456, 2560) == replace(pick_config(m, 19456, 2560), split_k=1)
    for m in (1, 16, 512):  # elsewhere int4_triton's tiles, in one K slice
        assert wt.pick_w8a16_config(m, 2560, 4096) == replace(pick_config(m, 2560, 4096), split_k=1)
    for m in (1, 16, 64, 65, 256, 512):
        assert wt.pick_w8a16_config(m, 2560, 9728).block_n >= 64


def test_one_k_slice_unless_split_k_is_asked_for(monkeypatch):
    """Decode sums K in one pass as cuBLAS does (the module docstring says why); SPLIT_K restores the
    split where 64 rows x 1024 columns leave most SMs idle."""
    assert all(wt.pick_w8a16_config(m, 1024, 3072).split_k == 1 for m in (1, 16, 64, 256))
    monkeypatch.setattr(wt, "SPLIT_K", True)
    assert wt.pick_w8a16_config(64, 1024, 3072).split_k > 1


@needs_kernel
def test_decode_rows_sum_k_in_one_slice(monkeypatch):
    """64 rows x 256 columns leave SMs idle, where the kernel used to split K: by default it runs
    no split and no reduction."""
    q, s = _operands(256, 1024)
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEV)
    monkeypatch.setattr(wt, "_splitk_reduce_kernel", NoSplitKReduction())
    assert _rel(wt.w8a16_linear_fused(x, q, s), wt.w8a16_linear(x, q, s).float()) < 1e-2


def test_refuses_what_it_does_not_handle():
    q, s = _operands(16, 256)
    x = torch.randn(2, 256, device=DEV)
    assert wt.fused_supported(x, q, s) is not None  # fp32 activations
    assert wt.fused_supported(x.bfloat16(), q, s[:, :1]) is not None  # scales do not fit K
    assert wt.fused_supported(x.bfloat16(), q.to(torch.bfloat16), s) is not None  # not an fp8 weight
    with pytest.raises(ValueError, match="w8a16_linear_fused"):
        wt.w8a16_linear_fused(x, q, s)


def test_auto_falls_back_to_the_reference_bitwise_on_cpu():
    q, s = _operands(24, 200)
    q, s = q.cpu(), s.cpu()
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(3, 200).to(dtype)
        bias = torch.randn(24).to(dtype)
        assert torch.equal(wt.w8a16_linear_auto(x, q, s, bias),
                           F.linear(x, dequantize_fp8_weight(q, s, dtype), bias))
