"""Straight-through fake quantization: forward = the rollout quantizer's round trip, backward = identity."""

import pytest
import torch
import torch.nn.functional as F

from miles.precision import (
    dequantize_fp8_act,
    dequantize_fp8_weight,
    dequantize_int4,
    fake_fp8_linear,
    fake_int4_linear,
    fake_quant_fp8_act,
    fake_quant_fp8_weight,
    fake_quant_int4,
    int4_linear,
    pack_int4,
    quantize_fp8_act,
    quantize_fp8_weight,
    quantize_int4,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_the_rollout_round_trip(dtype):
    w = torch.randn(130, 300).to(dtype)
    assert torch.equal(fake_quant_fp8_weight(w), dequantize_fp8_weight(*quantize_fp8_weight(w), dtype))
    x = torch.randn(3, 300).to(dtype)
    assert torch.equal(fake_quant_fp8_act(x), dequantize_fp8_act(*quantize_fp8_act(x), dtype))
    q, s = quantize_int4(w, 32)
    assert torch.equal(fake_quant_int4(w, 32), dequantize_int4(pack_int4(q), s, 32, k=300, dtype=dtype))


@pytest.mark.parametrize("fq", [fake_quant_fp8_weight, fake_quant_fp8_act, lambda t: fake_quant_int4(t, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ste_gradient_is_the_upstream_gradient(fq, dtype):
    w = (torch.randn(64, 160) * 3).to(dtype).requires_grad_()
    g = torch.randn(64, 160).to(dtype)
    fq(w).backward(g)
    assert w.grad.dtype == dtype and torch.equal(w.grad, g)


def test_ste_through_a_linear_layer():
    # d/dx and d/dw of fake_fp8_linear are those of a plain linear on the fake-quantized operands.
    x = torch.randn(4, 7, 256, requires_grad=True)
    w = torch.randn(96, 256, requires_grad=True)
    b = torch.randn(96, requires_grad=True)
    g = torch.randn(4, 7, 96)
    fake_fp8_linear(x, w, b).backward(g)
    xd = fake_quant_fp8_act(x).detach().requires_grad_()
    wd = fake_quant_fp8_weight(w).detach().requires_grad_()
    bd = b.detach().clone().requires_grad_()
    F.linear(xd, wd, bd).backward(g)
    assert torch.equal(x.grad, xd.grad) and torch.equal(w.grad, wd.grad) and torch.equal(b.grad, bd.grad)


def test_fake_quant_dtype_argument_rounds_once():
    w = torch.randn(128, 128)
    out = fake_quant_fp8_weight(w, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, dequantize_fp8_weight(*quantize_fp8_weight(w), torch.bfloat16))
    w.requires_grad_()
    fake_quant_fp8_weight(w, dtype=torch.bfloat16).float().sum().backward()
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad, torch.ones_like(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qat_forward_equals_the_engines_w4a16(dtype):
    w = torch.randn(40, 256)
    x = torch.randn(3, 256).to(dtype)
    q, s = quantize_int4(w, 128)
    assert torch.equal(fake_int4_linear(x, w, 128), int4_linear(x, pack_int4(q), s, 128))
