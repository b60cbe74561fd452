"""Policy losses beyond token-level PPO: sequence-level ratios (GSPO) and clipped IS weights (CISPO).

Same contract as `losses.ppo_clip_loss`: called as fn(logp, old_logp, advantages, mask, normalizer,
eps_clip=..., eps_clip_high=...) with [B, T] tensors, returning (loss, metrics); `agg_mode` and
`normalizer` follow `losses.aggregate`. `eps_clip` / `eps_clip_high` keep their names so the trainer
passes `algo.eps_clip` / `algo.eps_clip_high` unchanged, but each loss reads them in its own scale.
"""

from __future__ import annotations

import torch

from miles.algo.losses import aggregate
from miles.algo.registry import register_policy_loss


@register_policy_loss("gspo")
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float,
    eps_clip: float = 3e-4,
    eps_clip_high: float = 4e-4,
    agg_mode: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in its GSPO-token form (eq. 13).

    s_i = exp(mean_t (logp - old_logp)) over the sequence's loss tokens (length-normalized, so
    its scale does not depend on the length). Each token uses the ratio
    s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: its value is s_i, its gradient is s_i * grad logp_t.
    Loss per token = max(-A_t s_i,t, -A_t clip(s_i,t)), clipped per sequence (same value on every
    token) to [1 - eps_clip, 1 + eps_clip_high]. With per-sequence advantages (A_t = A_i, what every
    sequence-level estimator gives) this equals the paper's sequence-level GSPO in value and
    gradient; with per-token ones (GAE, on-policy distillation, token-level TIS) token t's gradient
    follows its own A_t, where differentiating s_i itself would give every token the sequence's mean
    advantage. The ratio is a geometric mean of token ratios, hence the small clip ranges (paper:
    3e-4 / 4e-4; set `algo.eps_clip` / `algo.eps_clip_high` accordingly). The paper's objective
    averages per sequence: agg_mode="seq_mean_token_mean"; the default token mean weighs each
    sequence by its length. With one loss token per sequence s_i is the token ratio and this is
    exactly `ppo_clip_loss`.
    Metrics: `ppo_kl` (token-level, as for PPO); `pg_clipfrac` = share of tokens in clipped sequences.
    """
    log_ratio = logp - old_logp
    seq_log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    # logp - sg[logp] is exactly 0 in value and 1 in gradient: `ratio` equals s_i bit for bit (so the
    # clip decisions are the sequence's), and d ratio / d logp_t = s_i for token t alone.
    ratio = torch.exp(seq_log_ratio.detach() + (logp - logp.detach()))  # [B, T]
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate(per_token, mask, agg_mode, normalizer)
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "ppo_kl": aggregate(-log_ratio, mask, agg_mode, normalizer),
            "pg_clipfrac": aggregate((clipped > unclipped).float(), mask, agg_mode, normalizer),
        }
    return loss, metrics


@register_policy_loss("cispo")
def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float,
    eps_clip: float = 1.0,
    eps_clip_high: float = 0.28,
    agg_mode: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): loss = -sg(clip(r, 1 - eps_clip, 1 + eps_clip_high)) * A * logp.

    PPO zeroes the gradient of clipped tokens, which are often the rare "wait / however" tokens
    that steer reasoning; CISPO clips the importance weight instead and keeps a gradient
    -w * A * grad(logp) for every token. The weight is a constant (stop-gradient), so the gradient
    flows through logp only; at r = 1 it equals PPO's. The paper sets no lower bound (eps_clip >= 1,
    the default here) and tunes only eps_clip_high. The loss value depends on logp itself and is not
    comparable with PPO's surrogate; only its gradient is meaningful.
    Metrics: `ppo_kl`; `pg_clipfrac` = share of tokens whose weight was clipped.
    """
    log_ratio = logp - old_logp
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    per_token = -weight * advantages * logp
    loss = aggregate(per_token, mask, agg_mode, normalizer)
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "ppo_kl": aggregate(-log_ratio, mask, agg_mode, normalizer),
            "pg_clipfrac": aggregate((weight != ratio).float(), mask, agg_mode, normalizer),
        }
    return loss, metrics
