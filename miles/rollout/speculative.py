"""Exact speculative sampling: verify k drafted tokens against the target model in one step.

    tokens, count, logp = verify_draft(target_logits, draft_probs, draft_tokens, temperature, top_p, top_k)
    # target_logits [B, k+1, V]: the target's logits at the k draft positions and the one after them
    # draft_probs [B, k, V]: the distributions the draft sampled from; draft_tokens [B, k]
    # -> tokens [B, k+1] (emitted, -1 past count), count [B] in 1..k+1, logp [B, k+1] (0 past count)

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft token x_i is kept with
probability min(1, p_i(x_i) / q_i(x_i)), where p is the target's distribution and q the draft's. The
first rejected position instead emits a token drawn from the residual max(p_i - q_i, 0), renormalized.
When all k are kept, one more token is drawn from p_k. Each emitted token is then distributed exactly
as the target's own sampling would give it, at any temperature and with any top-k / top-p (p is what
`sampling.sample_next` draws from). At temperature 0 a draft token is kept iff it is the target's
argmax, and the first mismatch emits that argmax, so the output equals plain greedy decoding.
`logp` holds the target's log-probs of the emitted tokens, log softmax(logits / temperature) before
truncation, as the engine reports them without speculation.

The engine's draft-and-verify loops that call it: miles/rollout/spec_decode.py (padded, every family,
MTP or draft model) and miles/rollout/spec_slots.py (slots with CUDA graphs, GQA draft models).
"""

from __future__ import annotations

import torch

from miles.rollout.sampling import sampling_probs


def verify_draft(target_logits: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                 temperature: float, top_p: float = 1.0, top_k: int = 0,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring. `draft_probs` may be anything at temperature 0 (greedy ignores it)."""
    rows, k = draft_tokens.shape
    arange = torch.arange(k + 1, device=draft_tokens.device)
    if temperature == 0:
        logp_all = torch.log_softmax(target_logits.float(), -1)
        best = logp_all.argmax(-1)  # [B, k+1]
        kept = _leading_true(draft_tokens == best[:, :k])
        tokens = best  # kept drafts equal the argmax; position `kept` is the correction or the bonus
    else:
        probs, logp_all = sampling_probs(target_logits, temperature, top_p, top_k)  # [B, k+1, V]
        p_x = probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
        u = torch.rand(rows, k, generator=generator, device=draft_tokens.device)
        kept = _leading_true(u * q_x < p_x)  # u < p/q without dividing by a q of 0
        # The next token: from the residual at the first rejection, from p_k when all were kept.
        at = kept.clamp(max=k)
        index = torch.arange(rows, device=draft_tokens.device)
        p_next = probs[index, at]
        # Where every draft was kept there is no q: the next token comes from p itself (no host sync).
        q_next = draft_probs[index, at.clamp(max=k - 1)] * (kept < k)[:, None]
        residual = (p_next - q_next).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # mass 0 only when p == q there, where no rejection can happen: p itself is the right law.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        next_token = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
        tokens = torch.cat([draft_tokens, draft_tokens[:, :1]], 1)
        tokens[torch.arange(rows), at] = next_token
    count = kept + 1
    valid = arange[None, :] < count[:, None]
    tokens = torch.where(valid, tokens, torch.full_like(tokens, -1))
    logp = logp_all.gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1) * valid
    return tokens, count, logp


def _leading_true(flags: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] long: how many flags are true before the first false."""
    return flags.long().cumprod(-1).sum(-1)
