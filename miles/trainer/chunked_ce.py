"""Log-probs (and entropy) of target tokens straight from final hidden states, chunk by chunk.

    logp, entropy = hidden_logprobs(hidden [M, H], weight [V, H], targets [M], temperature,
                                    with_entropy=True, chunk_tokens=4096)        # [M] fp32 each

The same numbers as `token_logprobs(hidden @ weight.T, targets, temperature)` and
`entropy_from_logits(logits / temperature)`, but the [M, V] logits (V = 152k for Qwen3: 600 MB
per 1k tokens in fp32) never exist whole: forward computes them `chunk_tokens` rows at a time and
keeps only the per-token results; backward recomputes each chunk's logits and turns them into the
gradients of the hidden states and of the weight at once. Under autocast the matmuls run in the
autocast dtype and the softmax in fp32, exactly as autocast's `F.linear` + `token_logprobs` do.
`chunk_tokens=0` materializes the logits whole (the reference path). On CUDA each chunk's softmax
(forward) and its gradient (backward) run as one Triton pass over the chunk's logits each
(miles/trainer/chunked_ce_triton.py), not as eager fp32 passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.algo.losses import entropy_from_logits, token_logprobs
from miles.trainer import chunked_ce_triton as fused

CHUNK_TOKENS = 4096  # 4096 x 152k fp32 logits = 2.5 GB per buffer; a chunk holds two or three at once


def hidden_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, chunk_tokens: int = CHUNK_TOKENS
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of each target under softmax(hidden @ weight.T / temperature), its entropy or None)."""
    temperature = 1.0 if temperature in (0.0, 1.0) else float(temperature)
    if chunk_tokens <= 0:
        logits = F.linear(hidden, weight)
        entropy = entropy_from_logits(logits.float() / temperature) if with_entropy else None
        return token_logprobs(logits, targets, temperature), entropy
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    logp, entropy = _ChunkedLogprobs.apply(hidden, weight, targets, temperature, with_entropy, chunk_tokens, dtype)
    return logp, entropy if with_entropy else None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / temperature of one chunk, from the matmul's output in the compute dtype (as autocast's)."""
    z = logits.float()
    return z.div_(temperature) if temperature != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, chunk, dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            logp = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
            entropy = torch.zeros_like(logp)
            lse = torch.empty_like(logp)  # logsumexp(logits / T) of each row, where the fused pass ran
            # Backward takes each chunk's forward path: it may run after the batch-invariant kernels'
            # mode ended (true on-policy), where `applies` would say yes to a chunk whose lse the
            # eager forward never wrote.
            ctx.fused_chunks = []
            for start in range(0, hidden.shape[0], chunk):
                end = start + chunk
                z = hidden[start:end].to(dtype) @ w.t()
                ctx.fused_chunks.append(fused.applies(z))
                if ctx.fused_chunks[-1]:
                    logp[start:end], lse[start:end], entropy[start:end] = fused.row_logprobs(
                        z, targets[start:end], temperature, with_entropy)
                    continue
                lp = torch.log_softmax(_scaled(z, temperature), dim=-1)
                logp[start:end] = lp.gather(1, targets[start:end, None]).squeeze(1)
                if with_entropy:
                    entropy[start:end] = -(lp.exp() * lp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, entropy, lse)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        # An unused entropy (entropy_coef 0) then costs backward nothing.
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        """Per chunk, with z = logits / T and log p = log_softmax(z): d logp_t / dz = onehot(t) - p
        and d H / dz = -p (log p + H), so dz = onehot(t) g_logp - p (g_logp + g_H (log p + H));
        then d logits = dz / T, d hidden = d logits @ W, d W = d logits^T @ hidden."""
        hidden, weight, targets, entropy, lse = ctx.saved_tensors
        t, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        if grad_logp is None:
            grad_logp = torch.zeros_like(entropy)
        grad_logp = grad_logp.contiguous()  # the fused pass reads one value per row
        grad_entropy = None if grad_entropy is None else grad_entropy.contiguous()
        grad_hidden = torch.empty_like(hidden)
        # A frozen head (the speculative draft's detached, shared one) takes no gradient: none computed.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start, fused_chunk in zip(range(0, hidden.shape[0], chunk), ctx.fused_chunks):
                end = start + chunk
                h = hidden[start:end].to(dtype)
                z = h @ w.t()
                g_entropy = None if grad_entropy is None else grad_entropy[start:end]
                if fused_chunk:
                    dz = fused.grad_logits_(z, lse[start:end], targets[start:end], grad_logp[start:end], g_entropy,
                                            entropy[start:end], t)
                else:
                    dz = _grad_logits(z, targets[start:end], grad_logp[start:end], g_entropy, entropy[start:end], t)
                grad_hidden[start:end] = dz @ w
                if grad_weight is not None:
                    grad_weight += (dz.t() @ h).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None, None


def _grad_logits(logits: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor,
                 grad_entropy: torch.Tensor | None, entropy: torch.Tensor, t: float) -> torch.Tensor:
    """The eager path of `_ChunkedLogprobs.backward`'s d loss / d logits for one chunk, in the logits' dtype."""
    lp = torch.log_softmax(_scaled(logits, t), dim=-1)
    g_logp = grad_logp[:, None]
    p = lp.exp()
    if grad_entropy is None:
        dz = p.mul_(g_logp)
    else:  # in place on lp: two [chunk, V] fp32 buffers at most
        dz = lp.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(g_logp).mul_(p)
    del p, lp
    dz.neg_().scatter_add_(1, targets[:, None], g_logp)
    if t != 1.0:
        dz.div_(t)
    return dz.to(logits.dtype)
