"""fp8_linear: the emulated backend is exactly dequantize-then-matmul, and equals the training forward."""

import pytest
import torch
import torch.nn.functional as F

from miles.precision import (
    dequantize_fp8_act,
    dequantize_fp8_weight,
    fake_fp8_linear,
    fp8_backend_report,
    fp8_linear,
    quantize_fp8_act,
    quantize_fp8_weight,
    resolve_fp8_backend,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [((5, 256), 384), ((2, 3, 200), 130)])
def test_emulated_equals_dequantize_then_matmul(dtype, shape):
    xs, n = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*xs, generator=g).to(dtype)
    w = torch.randn(n, xs[-1], generator=g)
    b = torch.randn(n, generator=g).to(dtype)
    q, s = quantize_fp8_weight(w)
    y = fp8_linear(x, q, s, b, backend="emulated")
    ref = F.linear(dequantize_fp8_act(*quantize_fp8_act(x), dtype), dequantize_fp8_weight(q, s, dtype), b)
    assert y.dtype == dtype and y.shape == (*xs[:-1], n)
    assert torch.equal(y, ref)
    # the training forward (fake quantization + STE) computes the very same bits
    assert torch.equal(fake_fp8_linear(x, w, b), y)


def test_emulated_in_fp32_for_bf16_inputs_and_w8a16():
    x = torch.randn(4, 256).to(torch.bfloat16)
    q, s = quantize_fp8_weight(torch.randn(64, 256))
    y = fp8_linear(x, q, s, backend="emulated", out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert torch.equal(y, F.linear(dequantize_fp8_act(*quantize_fp8_act(x)), dequantize_fp8_weight(q, s)))
    y16 = fp8_linear(x, q, s, quantize_act=False)
    assert torch.equal(y16, F.linear(x, dequantize_fp8_weight(q, s, torch.bfloat16)))


def test_error_against_the_high_precision_gemm_is_small():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 512, generator=g), torch.randn(256, 512, generator=g)
    y = fp8_linear(x, *quantize_fp8_weight(w), backend="emulated")
    ref = x @ w.t()
    # two operands each off by <= 2^-4 relative: the dot products are off by well under 10% of their scale
    assert ((y - ref).abs().max() / ref.abs().max()) < 0.05


def test_backend_selection_on_cpu():
    assert resolve_fp8_backend("auto", "cpu") == "emulated"
    report = fp8_backend_report("cpu")
    assert report["emulated"].startswith("ok") and "CUDA" in report["scaled_mm"]
    x = torch.randn(2, 128)
    q, s = quantize_fp8_weight(torch.randn(16, 128))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        fp8_linear(x, q, s, backend="scaled_mm")
    with pytest.raises(ValueError, match="unknown fp8 backend"):
        fp8_linear(x, q, s, backend="cutlass")
    with pytest.raises(ValueError, match="emulated backend only"):
        fp8_linear(x, q, s, backend="scaled_mm", quantize_act=False)
    with pytest.raises(ValueError, match="K="):
        fp8_linear(torch.randn(2, 64), q, s)


def test_deterministic():
    x = torch.randn(16, 300)
    q, s = quantize_fp8_weight(torch.randn(200, 300))
    assert torch.equal(fp8_linear(x, q, s), fp8_linear(x, q, s))


def test_scaled_mm_operand_layouts_on_cpu():
    # The layouts are plain tensor bookkeeping, checkable without a GPU; the GPU probe checks the numbers.
    from miles.precision import FP8_DTYPE, prepare_scaled_mm_weight, quantize_act_for_scaled_mm

    x = torch.randn(33, 300)
    xq, xs = quantize_act_for_scaled_mm(x, 384)
    assert xq.shape == (48, 384) and xs.shape == (48, 3) and xs.stride() == (1, 48)
    q_ref, s_ref = quantize_fp8_act(x)
    assert torch.equal(xq[:33, :300].view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(xs[:33], s_ref)
    assert (xq[33:].view(torch.uint8) == 0).all() and (xq[:, 300:].view(torch.uint8) == 0).all()

    q, s = quantize_fp8_weight(torch.randn(200, 300))
    for layout, shape, stride in [("v1_padded", (3, 2), (1, 4)), ("v1_contiguous", (3, 2), (1, 3)),
                                  ("v2", (4, 2), (1, 4))]:
        p = prepare_scaled_mm_weight(q, s, layout)
        assert p.q.shape == (256, 384) and p.q.dtype == FP8_DTYPE and (p.n, p.k) == (200, 300)
        assert torch.equal(p.q[:200, :300].view(torch.uint8), q.view(torch.uint8))
        assert p.scale_b.shape == shape and p.scale_b.stride() == stride
        assert torch.equal(p.scale_b.t()[:, :3] if layout == "v2" else p.scale_b.t(), s)
    with pytest.raises(ValueError, match="layout"):
        prepare_scaled_mm_weight(q, s, "v3")


def test_a_deep_gemm_that_does_not_load_is_reported_not_raised(monkeypatch):
    """An installed DeepGEMM whose compiled operators do not match this torch (sgl-deep-gemm 0.2.5 on
    torch 2.11: OSError, undefined symbol) must leave "auto" on the next backend, with the reason."""
    import miles.precision.fp8_gemm as fg

    def broken():
        raise OSError("Could not load this library: .../deep_gemm/_C.so") from OSError(
            "_C.so: undefined symbol: _ZN3c104cuda19CUDAErrorLogCaptureC1Ev")

    monkeypatch.setattr(fg, "_import_deep_gemm", broken)
    monkeypatch.setattr(fg, "_PROBES", {})
    monkeypatch.setattr(fg, "_device", lambda d: torch.device("cuda", 0))  # the import is tried on CUDA only
    ok, why = fg._probe_cached("deep_gemm", torch.device("cuda", 0))
    assert not ok and "does not load" in why and "undefined symbol" in why
