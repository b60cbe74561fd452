"""The training side's FP8 nn.Linear (miles/precision/fp8_train.py) on the CPU, where its GEMM is the
emulated one: it gives the old fake-quantized forward's bits and gradients, runs the engine's
QuantLinear arithmetic, and quantizes each weight once per version of it.
(On CUDA, where both sides run torch._scaled_mm: tests/gpu/test_fp8_fused_cuda.py.)"""

import pytest
import torch
import torch.nn.functional as F

from miles.precision import fake_quant_fp8_act, fake_quant_fp8_weight, quantize_fp8_weight
from miles.precision.fp8_gemm import fp8_linear, fp8_linear_with, prepare_fp8_weight
from miles.precision.fp8_train import FP8WeightCache, fp8_train_linear


def _fake_linear(x, w, b, dtype):
    """The training forward before: dequantize(quantize(.)) of both operands, then F.linear."""
    return F.linear(fake_quant_fp8_act(x.to(dtype)), fake_quant_fp8_weight(w, dtype=dtype),
                    None if b is None else b.to(dtype))


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_gradients_equal_the_fake_quantized_linear(autocast, bias):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 5, 384, generator=g)
    w0 = torch.randn(200, 384, generator=g) * 0.05
    b0 = torch.randn(200, generator=g) if bias else None
    dtype = torch.bfloat16 if autocast else torch.float32
    outs, grads = [], []
    for fn in (lambda x, w, b: fp8_train_linear(x, w, b, FP8WeightCache()), lambda x, w, b: _fake_linear(x, w, b, dtype)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = None if b0 is None else b0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = fn(x, w, b)
        (y.float() * torch.linspace(-1, 1, 200)).sum().backward()
        outs.append(y)
        grads.append([t.grad for t in (x, w, b) if t is not None])
    assert outs[0].dtype == outs[1].dtype == dtype
    assert torch.equal(outs[0], outs[1])
    for ours, theirs in zip(*grads):
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, rtol=1e-5 if not autocast else 1e-2, atol=1e-6)


def test_trainer_layer_gives_the_engine_layers_bits():
    """The engine multiplies the payload (quantize_fp8_weight of the master weight) through
    fp8_linear_with; the trainer's layer, from the master weight, gives the same bits."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(256, 300, generator=g), torch.randn(256, generator=g)
    x = torch.randn(7, 300, generator=g)
    engine = fp8_linear_with(x, prepare_fp8_weight(*quantize_fp8_weight(w)), b)
    assert torch.equal(engine, fp8_linear(x, *quantize_fp8_weight(w), b))
    assert torch.equal(fp8_train_linear(x, w, b, FP8WeightCache()), engine)


def test_cache_quantizes_once_per_weight_version():
    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(256, 128)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, foreach=True)
    cache = FP8WeightCache()
    x = torch.randn(4, 256, generator=g)
    first = fp8_train_linear(x, lin.weight, lin.bias, cache)
    operand = cache.operand(lin.weight)
    assert cache.operand(lin.weight) is operand  # no new quantization for the same weight
    first.square().sum().backward()
    opt.step()  # an in-place update: the next forward must see the new weight
    after = fp8_train_linear(x, lin.weight, lin.bias, cache)
    assert cache.operand(lin.weight) is not operand
    assert torch.equal(after, fp8_train_linear(x, lin.weight, lin.bias, FP8WeightCache()))
    assert not torch.equal(after, first)
    cache.clear()
    assert len(cache) == 0
