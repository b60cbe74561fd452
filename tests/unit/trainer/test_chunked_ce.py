"""Chunked LM head + log-softmax: the values and gradients of the whole-logits path.

Tolerance: fp32 1e-6 (same math in chunks: float rounding only; for gradients, which sum M
per-token terms, 1e-6 of the largest element); bf16 autocast 2e-2 relative
(the matmuls round to bf16 on both paths, the gradient sums over chunks in another order).
"""

import pytest
import torch

from miles.algo.losses import entropy_from_logits, token_logprobs
from miles.trainer.chunked_ce import hidden_logprobs

M, H, V = 37, 16, 50


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=gen, requires_grad=True)
    weight = (torch.randn(V, H, generator=gen) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (M,), generator=gen)
    return hidden, weight, targets


def _reference(hidden, weight, targets, temperature):
    logits = hidden @ weight.t()
    return token_logprobs(logits, targets, temperature), entropy_from_logits(logits.float() / temperature)


def _assert_grads_close(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6 * float(w.abs().max()), rtol=1e-6)


def _grads(outputs, inputs, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=gen) for o in outputs]
    loss = sum((o * w).sum() for o, w in zip(outputs, weights))
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("chunk", [5, 16, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunks_equal_whole_logits_fp32(chunk, temperature):
    hidden, weight, targets = _inputs()
    logp, entropy = hidden_logprobs(hidden, weight, targets, temperature, with_entropy=True, chunk_tokens=chunk)
    ref_logp, ref_entropy = _reference(hidden, weight, targets, temperature)
    torch.testing.assert_close(logp, ref_logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-6, rtol=1e-6)
    _assert_grads_close(_grads((logp, entropy), (hidden, weight)), _grads((ref_logp, ref_entropy), (hidden, weight)))


def test_logprobs_alone_have_the_reference_gradient():
    hidden, weight, targets = _inputs(3)
    logp, entropy = hidden_logprobs(hidden, weight, targets, 1.0, with_entropy=False, chunk_tokens=8)
    assert entropy is None
    ref_logp, _ = _reference(hidden, weight, targets, 1.0)
    _assert_grads_close(_grads((logp,), (hidden, weight)), _grads((ref_logp,), (hidden, weight)))


def test_unused_entropy_costs_no_gradient_term():
    # entropy computed (a metric) but not in the loss: the same gradient as the log-probs alone
    hidden, weight, targets = _inputs(4)
    logp, entropy = hidden_logprobs(hidden, weight, targets, 1.0, with_entropy=True, chunk_tokens=8)
    ref_logp, _ = _reference(hidden, weight, targets, 1.0)
    _assert_grads_close(_grads((logp,), (hidden, weight)), _grads((ref_logp,), (hidden, weight)))


def test_bf16_autocast_matches_autocast_linear():
    hidden, weight, targets = _inputs(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = hidden_logprobs(hidden, weight, targets, 1.0, with_entropy=True, chunk_tokens=8)
        ref_logp, ref_entropy = _reference(hidden, weight, targets, 1.0)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(entropy, ref_entropy, atol=2e-2, rtol=2e-2)
    got = _grads((logp, entropy), (hidden, weight))
    want = _grads((ref_logp, ref_entropy), (hidden, weight))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32
        assert (g - w).norm() <= 2e-2 * w.norm()
