"""The softmax half of the chunked LM head (miles/trainer/chunked_ce.py) as two Triton kernels on CUDA.

    logp, lse, entropy = row_logprobs(logits, targets, temperature, with_entropy)   # forward
    grad_logits_(logits, lse, targets, grad_logp, grad_entropy, entropy, temperature)  # backward, in place

`logits` is one chunk's [M, V] product in the compute dtype (bf16), as cuBLAS wrote it. The eager
path turns it into fp32 logits / T, a log-softmax, a gather (and exp / multiply / negate / scatter /
cast in backward): ~10 passes over [M, V] fp32 buffers, 2.5 GB each at 4096 x 152k. A profile of
`train_rl` on the Qwen3-0.6B shape (16 x 2048 tokens, one H100) put that softmax work at ~60 ms of a
695 ms step (docs/benchmarks.md). Here one program per row reads the row once in forward (online
max / sum of exp, fp32, and the target's logit) and once in backward, writing the logits' gradient
over them in the compute dtype: the matmuls around them are unchanged.

Numerics: z = logits / T in fp32 as the eager path divides (IEEE division), log p = z - logsumexp(z).
The sums run in another order than torch's log_softmax, so log-probs differ from the eager path's by
fp32 rounding (~1e-7 relative); the gradient is rounded to the compute dtype as the eager path rounds
it. Not used under batch-invariant kernels (true on-policy), where the eager path's fixed order is
what the engine reproduces.
"""

from __future__ import annotations

import torch

from miles.precision import invariance
from miles.precision.int4_triton import _interpreting

try:  # triton ships with CUDA torch wheels; the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

BLOCK_V = 2048
# On/off for the whole process: benchmarks compare the two paths side by side.
enabled = True


def applies(logits: torch.Tensor) -> bool:
    """Whether this chunk's softmax runs here (else the eager path): CUDA (or the interpreter in
    tests), a half-precision compute dtype, not under batch-invariant kernels."""
    device_ok = logits.is_cuda or (_interpreting() and triton is not None)
    return (enabled and triton is not None and device_ok and logits.dtype in (torch.bfloat16, torch.float16)
            and logits.is_contiguous() and not invariance.active())


if triton is not None:
    from miles.precision.int4_triton import _round

    @triton.jit
    def _scaled(x, t, SCALE: tl.constexpr):
        # logits / T as the eager path's `z.div_(T)`: IEEE division, not a multiply by 1 / T (the
        # divisor broadcast to x's shape, as fp8_triton.py passes it).
        if SCALE:
            return tl.math.div_rn(x, tl.zeros_like(x) + t)
        else:
            return x

    @triton.jit
    def _forward_kernel(z_ptr, target_ptr, logp_ptr, lse_ptr, ent_ptr, V, t,
                        SCALE: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * V
        offs = tl.arange(0, BLOCK)
        # The first block starts the running max m, sum s of exp(z - m) and sz, the sum of
        # exp(z - m) * (z - m) (the entropy is log s - sz / s: no cancellation against lse).
        ok = offs < V
        z = _scaled(tl.load(base + offs, mask=ok, other=float("-inf")).to(tl.float32), t, SCALE)
        m = tl.max(z, 0)
        shift = tl.where(ok, z - m, 0.0)
        e = tl.where(ok, tl.exp(shift), 0.0)
        s = tl.sum(e, 0)
        sz = tl.sum(e * shift, 0)
        for start in range(BLOCK, V, BLOCK):
            cols = start + offs
            ok = cols < V
            z = _scaled(tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32), t, SCALE)
            m_new = tl.maximum(m, tl.max(z, 0))
            shift = tl.where(ok, z - m_new, 0.0)
            e = tl.where(ok, tl.exp(shift), 0.0)
            delta = m - m_new
            rescale = tl.exp(delta)
            if ENTROPY:
                sz = rescale * (sz + delta * s) + tl.sum(e * shift, 0)
            s = s * rescale + tl.sum(e, 0)
            m = m_new
        lse = m + tl.log(s)
        target = tl.load(target_ptr + row)
        z_t = _scaled(tl.load(base + target).to(tl.float32), t, SCALE)
        tl.store(logp_ptr + row, z_t - lse)
        tl.store(lse_ptr + row, lse)
        if ENTROPY:
            tl.store(ent_ptr + row, tl.log(s) - sz / s)

    @triton.jit
    def _backward_kernel(z_ptr, lse_ptr, target_ptr, glogp_ptr, gent_ptr, ent_ptr, V, t,
                         SCALE: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
                         INTERPRET: tl.constexpr):
        # d log p_t / dz = onehot(t) - p, d H / dz = -p (log p + H); the gradient of the logits is
        # dz / T, written over the row's logits in their dtype.
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * V
        offs = tl.arange(0, BLOCK)
        lse = tl.load(lse_ptr + row)
        g = tl.load(glogp_ptr + row)
        target = tl.load(target_ptr + row)
        if ENTROPY:
            g_h = tl.load(gent_ptr + row)
            h = tl.load(ent_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + offs
            ok = cols < V
            logp = _scaled(tl.load(base + cols, mask=ok, other=0.0).to(tl.float32), t, SCALE) - lse
            p = tl.exp(logp)
            if ENTROPY:
                dz = -(p * ((logp + h) * g_h + g))
            else:
                dz = -(p * g)
            dz = tl.where(cols == target, dz + g, dz)
            dz = _scaled(dz, t, SCALE)
            tl.store(base + cols, _round(dz, z_ptr.dtype.element_ty, INTERPRET), mask=ok)


def row_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[M, V] logits (compute dtype), [M] targets -> fp32 [M] each: log-prob of the target under
    softmax(logits / T), logsumexp(logits / T) (what backward needs), entropy (zeros without it)."""
    m, v = logits.shape
    logp = torch.empty(m, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(logp)
    entropy = torch.zeros_like(logp)
    if m:
        _forward_kernel[(m,)](logits, targets, logp, lse, entropy, v, float(temperature),
                              SCALE=temperature != 1.0, ENTROPY=with_entropy, BLOCK=BLOCK_V, num_warps=8)
    return logp, lse, entropy


def grad_logits_(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor,
                 grad_entropy: torch.Tensor | None, entropy: torch.Tensor, temperature: float) -> torch.Tensor:
    """Overwrite [M, V] `logits` with the gradient of the loss with respect to them (d loss / d logits,
    in the logits' dtype) and return it."""
    m, v = logits.shape
    if m:
        with_entropy = grad_entropy is not None
        _backward_kernel[(m,)](logits, lse, targets, grad_logp, grad_entropy if with_entropy else grad_logp,
                               entropy, v, float(temperature), SCALE=temperature != 1.0, ENTROPY=with_entropy,
                               BLOCK=BLOCK_V, INTERPRET=_interpreting(), num_warps=8)
    return logits
