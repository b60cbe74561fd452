"""Policy losses and token aggregation. Each loss returns (loss scalar, metrics dict of tensors).

Shapes: `logp`, `old_logp`, `advantages`, `mask` are [B, T] over response tokens. `normalizer` is the
number of loss tokens in the whole optimizer step, so that micro-batches accumulated over several
backward passes add up to the token mean of the global batch.
"""

from __future__ import annotations

import torch

from miles.algo.registry import register_policy_loss


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with separate low / high clip ranges (DAPO).

    loss = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high)), r = exp(logp - old_logp).
    Metrics: `ppo_kl` = token-mean of (old_logp - logp); `pg_clipfrac` = share of tokens where the
    clipped term is the one taken. Both are exactly 0 when logp equals old_logp.
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = masked_sum(per_token, mask) / normalizer
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "ppo_kl": masked_sum(-log_ratio, mask) / normalizer,
            "pg_clipfrac": masked_sum((clipped > unclipped).float(), mask) / normalizer,
        }
    return loss, metrics


@register_policy_loss("nll")
def nll_loss(
    logp: torch.Tensor, mask: torch.Tensor, normalizer: float, **_: object
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SFT: token-mean negative log-likelihood of the target tokens."""
    loss = -masked_sum(logp, mask) / normalizer
    return loss, {"nll": loss.detach()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the categorical distribution, [B, T, V] -> [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of each target token under softmax(logits / temperature): [B, T, V], [B, T] -> [B, T]."""
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return torch.gather(torch.log_softmax(logits, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)
