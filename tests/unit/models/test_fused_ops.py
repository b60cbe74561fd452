"""The fused elementwise ops (miles/models/fused.py): their written-out backward against autograd of
the eager op, and a forward that is the same kernel whether or not autograd records the call.

The CUDA engine and trainer run these ops compiled; on an H100 the compiled RMSNorm's training
kernel rounded otherwise than its no-grad kernel, so a separate no-grad pass for the old log-probs
missed the training forward (first-step ppo_kl 1.5e-8 instead of 0). Here the ops run on the CPU:
uncompiled for the gradient formulas, and compiled with Inductor's CPU backend for the forward's
identity (`slow`: ~20 s of compilation per op on 2 cores)."""

import pytest
import torch

from miles.models import fused


def _inputs(name: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)

    def rand(*shape, grad=True):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)

    if name == "rms_norm":  # an fp32 master weight under a bf16 stream, as the trainer holds it
        return rand(3, 5, 64), torch.randn(64, generator=g).add(1).requires_grad_(), 1e-6
    if name == "rotate":  # [B, H, T, D] with float32 tables [B, T, D]
        angles = torch.rand(3, 5, 32, generator=g, dtype=torch.float64) * 6
        return rand(3, 4, 5, 32), angles.cos().float(), angles.sin().float()
    return rand(3, 5, 48), rand(3, 5, 48)


def _grads(fn, args, out_grad):
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    for t in tensors:
        t.grad = None
    out = fn(*args)
    out.backward(out_grad)
    return out.detach(), [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("name", sorted(fused.EAGER))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_written_out_backward_is_autograds(name, dtype):
    args = _inputs(name, dtype)
    out_grad = torch.randn(fused.EAGER[name](*args).shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want_out, want = _grads(fused.EAGER[name], args, out_grad)
    op = fused._differentiable(name, fused.EAGER[name], fused.BACKWARD[name])
    got_out, got = _grads(op, args, out_grad)
    assert torch.equal(got_out, want_out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: autograd rounds its intermediates to bf16
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.allclose(g.double(), w.double(), rtol=tol, atol=tol), (g - w).abs().max()


def test_a_wrong_backward_fails_the_comparison():
    """Negative control: d up of silu_mul without the sigmoid is caught."""
    args = _inputs("silu_mul", torch.float32)
    out_grad = torch.ones(3, 5, 48)
    _, want = _grads(fused.EAGER["silu_mul"], args, out_grad)
    wrong = fused._differentiable("silu_mul", fused.EAGER["silu_mul"],
                                  lambda grad, gate, up: (fused.silu_mul_backward(grad, gate, up)[0], grad * gate))
    _, got = _grads(wrong, args, out_grad)
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[1], want[1], rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_compiled_forward_is_the_same_with_and_without_grad():
    """The compiled op (Inductor) gives the same bits in a recorded call, a no-grad call and a call
    whose inputs need no gradient, and its gradient is autograd's of the eager op."""
    compile_ = lambda fn: torch.compile(fn, dynamic=True, fullgraph=True)  # noqa: E731
    op = fused._differentiable("rms_norm", compile_(fused.rms_norm), compile_(fused.rms_norm_backward))
    x, weight, eps = _inputs("rms_norm", torch.bfloat16)
    recorded = op(x, weight, eps)
    with torch.no_grad():
        unrecorded = op(x, weight, eps)
    detached = op(x.detach(), weight.detach(), eps)
    assert torch.equal(recorded, unrecorded) and torch.equal(recorded, detached)
    out_grad = torch.randn(recorded.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    _, want = _grads(fused.rms_norm, (x, weight, eps), out_grad)
    _, got = _grads(op, (x, weight, eps), out_grad)
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w.double(), rtol=2e-2, atol=2e-2)
