"""The one-pass dequantization kernel (miles/precision/dequant_triton.py) against the eager
dequantize_fp8_weight / dequantize_int4: the same bits, for every output dtype and at ragged edges.
On a CPU machine through the Triton interpreter (a subprocess with TRITON_INTERPRET=1, see
triton_interpreter.py); on a CUDA machine compiled (tests/gpu runs this file too)."""

import os

import pytest
import torch

from triton_interpreter import run_under_interpreter

from miles.precision.dequant_triton import dequantize_one_pass, one_pass_supported, triton
from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight
from miles.precision.int4 import dequantize_int4, pack_int4, quantize_int4

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHILD = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel = pytest.mark.skipif(triton is None or not (DEV == "cuda" or CHILD),
                                  reason="kernel tests run on CUDA or in the interpreter subprocess")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.skipif(DEV != "cpu" or CHILD or triton is None, reason="only the CPU parent starts it")
def test_kernels_under_interpreter():
    run_under_interpreter(__file__)


def _expected(eager, dtype):
    """The eager result in `dtype`, from its fp32 one. Under the interpreter a bf16 store truncates
    fp32 (numpy has no bf16), where compiled code rounds to nearest as torch does: there the fp32
    products are checked bit for bit and the bf16 result against their truncation."""
    if CHILD and dtype == torch.bfloat16:
        return (eager(torch.float32).view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return eager(dtype)


def _weight(n, k, seed=0):
    """Rows of very different magnitudes (2^-8..2^8) with exact zeros and extremes."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-8, 9, (n, 1), generator=g).float())
    w = torch.randn(n, k, generator=g) * rows
    w[0, : min(k, 6)] = torch.tensor([0.0, -0.0, 448.0, -448.0, 1e-6, 7.0])[: min(k, 6)]
    return w


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (33, 130), (1, 5)])
def test_fp8_equals_the_eager_dequantization(n, k, dtype):
    q, s = quantize_fp8_weight(_weight(n, k))
    q, s = q.to(DEV), s.to(DEV)
    assert one_pass_supported(q, s, "fp8", dtype) is None
    expected = _expected(lambda dt: dequantize_fp8_weight(q, s, dt), dtype)
    assert torch.equal(dequantize_one_pass(q, s, "fp8", dtype), expected)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,group", [(256, 384, 128), (70, 300, 32), (9, 257, 128), (3, 6, 32)])
def test_int4_equals_the_eager_dequantization(n, k, group, dtype):
    codes, s = quantize_int4(_weight(n, k), group)
    packed, s = pack_int4(codes).to(DEV), s.to(DEV)
    assert one_pass_supported(packed, s, "int4", dtype) is None
    got = dequantize_one_pass(packed, s, "int4", dtype, group=group, k=k)
    assert torch.equal(got, _expected(lambda dt: dequantize_int4(packed, s, group, k=k, dtype=dt), dtype))


def test_what_it_does_not_take_is_named():
    q, s = quantize_fp8_weight(torch.randn(2, 128, 128))
    assert "2-D" in one_pass_supported(q, s, "fp8", torch.bfloat16)
    q, s = quantize_fp8_weight(torch.randn(128, 128))
    assert "bf16 / fp16 / fp32" in one_pass_supported(q, s, "fp8", torch.int8)
    assert "fp8 or int4" in one_pass_supported(q, s, "nf4", torch.bfloat16)


@pytest.mark.skipif(DEV != "cuda", reason="the *_linear_auto dispatch takes CUDA tensors")
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_linear_auto_above_the_fused_rows_gives_the_eager_bits(fmt, monkeypatch):
    """dequant_triton.ENABLED: fp8_w8a16_triton / int4_triton's dequantize-then-cuBLAS path (rows
    above FUSED_MAX_ROWS) through the one-pass kernel, bit for bit the eager path."""
    from miles.precision import dequant_triton, fp8_w8a16_triton, int4_triton

    w, x = _weight(384, 512).to(DEV), torch.randn(2048, 512, device=DEV, dtype=torch.bfloat16)
    if fmt == "fp8":
        q, s = quantize_fp8_weight(w)
        auto, eager = fp8_w8a16_triton.w8a16_linear_auto, fp8_w8a16_triton.w8a16_linear
    else:
        codes, s = quantize_int4(w, 128)
        q = pack_int4(codes)
        auto, eager = int4_triton.int4_linear_auto, int4_triton.int4_linear
    monkeypatch.setattr(dequant_triton, "ENABLED", True)
    called = []
    monkeypatch.setattr(dequant_triton, "dequantize_one_pass",
                        lambda *a, **kw: called.append(1) or dequantize_one_pass(*a, **kw))
    assert torch.equal(auto(x, q, s), eager(x, q, s))
    assert called  # 2048 rows: above FUSED_MAX_ROWS, through the kernel
