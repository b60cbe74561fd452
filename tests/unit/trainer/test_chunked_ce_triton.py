"""The fused softmax passes of the chunked LM head (miles/trainer/chunked_ce_triton.py) against the
eager path of miles/trainer/chunked_ce.py on the same bf16 logits: on the CPU through the Triton
interpreter (a subprocess with TRITON_INTERPRET=1), compiled on a CUDA machine.

Tolerances: log-probs and entropies 2e-6 absolute (fp32 sums in another order than log_softmax's);
the gradient of the logits is rounded to bf16 on both sides, so it may differ by one bf16 step of the
larger magnitude (at most 2^-7 relative) where the fp32 values straddle a rounding boundary.
"""

import os

import pytest
import torch

from triton_interpreter import run_under_interpreter

from miles.models import invariant
from miles.trainer import chunked_ce
from miles.trainer import chunked_ce_triton as fused

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHILD = os.environ.get("TRITON_INTERPRET") == "1"
RUNS_KERNEL = fused.triton is not None and (DEV == "cuda" or CHILD)
needs_kernel = pytest.mark.skipif(not RUNS_KERNEL, reason="kernel tests run on CUDA or in the interpreter subprocess")


@pytest.mark.skipif(DEV != "cpu" or CHILD or fused.triton is None, reason="only the CPU parent starts it")
def test_kernels_under_interpreter():
    run_under_interpreter(__file__)


def _logits(m: int, v: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(m, v, generator=g) * 4).to(torch.bfloat16)  # peaked rows as well as flat ones
    targets = torch.randint(0, v, (m,), generator=g)
    return logits.to(DEV), targets.to(DEV)


def _eager_forward(logits, targets, t):
    lp = torch.log_softmax(chunked_ce._scaled(logits, t), dim=-1)
    return lp.gather(1, targets[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1), torch.logsumexp(
        chunked_ce._scaled(logits, t), -1)


# V: one block short of full, several blocks with a partial last one (a Qwen-size vocabulary is 74 blocks).
@needs_kernel
@pytest.mark.parametrize("v", [1000, 2 * fused.BLOCK_V + 37])
@pytest.mark.parametrize("t", [1.0, 0.7])
def test_forward_matches_the_eager_log_softmax(v, t):
    logits, targets = _logits(5, v)
    assert fused.applies(logits)
    logp, lse, entropy = fused.row_logprobs(logits, targets, t, with_entropy=True)
    ref_logp, ref_entropy, ref_lse = _eager_forward(logits, targets, t)
    torch.testing.assert_close(logp, ref_logp, atol=2e-6, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=2e-6, rtol=0)
    # The entropy sums V terms of p log p in another order than eager's (~8 nats at V = 4133): fp32 sums
    # differ by a few ulps of the total (2.1e-6 on an AVX2 EPYC, under 2e-6 on AVX-512 Xeons).
    torch.testing.assert_close(entropy, ref_entropy, atol=2e-6, rtol=1e-6)
    _, _, no_entropy = fused.row_logprobs(logits, targets, t, with_entropy=False)
    assert float(no_entropy.abs().max()) == 0.0


@needs_kernel
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("t", [1.0, 0.7])
def test_backward_matches_the_eager_gradient(with_entropy, t):
    v = 2 * fused.BLOCK_V + 37
    logits, targets = _logits(6, v, seed=1)
    g = torch.Generator().manual_seed(2)
    grad_logp = torch.randn(6, generator=g).to(DEV)
    grad_entropy = torch.randn(6, generator=g).to(DEV) if with_entropy else None
    _, lse, entropy = fused.row_logprobs(logits, targets, t, with_entropy=True)
    want = chunked_ce._grad_logits(logits.clone(), targets, grad_logp, grad_entropy, entropy, t)
    got = fused.grad_logits_(logits.clone(), lse, targets, grad_logp, grad_entropy, entropy, t)
    assert got.dtype == torch.bfloat16
    step = want.float().abs().clamp(min=1e-30) * 2.0 ** -7  # one bf16 rounding step (2^-8 to 2^-7 relative)
    assert bool(((got.float() - want.float()).abs() <= step + 1e-12).all())
    # The target column carries + grad_logp: a wrong column moves it by ~|grad_logp|.
    rows = torch.arange(6, device=logits.device)
    assert float((got[rows, targets].float() - want[rows, targets].float()).abs().max()) < 1e-2


def _head_run(invariant_forward: bool = False):
    """hidden_logprobs of a small head under bf16 autocast (the forward under the batch-invariant
    kernels with `invariant_forward`, as true on-policy runs it; backward after the mode ended), and
    the gradients of a loss on its log-probs and entropies."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 16, generator=g).to(DEV).requires_grad_()
    weight = (torch.randn(fused.BLOCK_V + 5, 16, generator=g) * 0.5).to(DEV).requires_grad_()
    targets = torch.randint(0, fused.BLOCK_V + 5, (9,), generator=g).to(DEV)
    with torch.autocast(DEV, dtype=torch.bfloat16), invariant.kernels(invariant_forward):
        logp, entropy = chunked_ce.hidden_logprobs(hidden, weight, targets, 0.7, with_entropy=True, chunk_tokens=4)
    grads = torch.autograd.grad((logp * 0.3).sum() + (entropy * 0.1).sum(), (hidden, weight))
    return logp, entropy, grads


def _eager_head_run(invariant_forward: bool = False):
    original = fused.applies
    fused.applies = lambda logits: False
    try:
        return _head_run(invariant_forward)
    finally:
        fused.applies = original


@needs_kernel
def test_the_chunked_head_takes_the_fused_path_under_autocast():
    """hidden_logprobs under bf16 autocast gives the eager path's values and gradients with the fused
    passes on (CUDA / the interpreter) as with them off."""
    logp, entropy, grads = _head_run()
    ref_logp, ref_entropy, ref_grads = _eager_head_run()
    torch.testing.assert_close(logp, ref_logp, atol=2e-6, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=2e-6, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-2 * float(want.abs().max()), rtol=0)


@needs_kernel
def test_backward_takes_the_forwards_path_after_the_invariant_mode():
    """True on-policy: the forward ran the eager path under the batch-invariant kernels and backward
    runs after the mode ended. Backward must take the eager path too: the fused one reads the rows'
    logsumexp, which only the fused forward writes (on an H100 it read uninitialized memory: wrong
    gradients, NaN after a few steps)."""
    _, _, grads = _head_run(invariant_forward=True)
    _, _, want = _eager_head_run(invariant_forward=True)
    for got, ref in zip(grads, want):
        assert torch.equal(got, ref)
