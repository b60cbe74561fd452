"""Policy losses and token aggregation. Each loss returns (loss scalar, metrics dict of tensors).

Shapes: `logp`, `old_logp`, `advantages`, `mask` are [B, T] over response tokens. `normalizer` is the
number of loss tokens in the whole optimizer step (for the default "token_mean" aggregation; see
`aggregate` for the others), so that micro-batches accumulated over several backward passes add up
to the token mean of the global batch. Metrics are aggregated like the loss so that they add up
too; they are token means (fractions for the *_clipfrac ones) under "token_mean".
"""

from __future__ import annotations

from typing import Sequence

import torch

from miles.algo.registry import register_policy_loss


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: float) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar; `normalizer` is a global count for the optimizer step.

    Every mode is a sum over the micro-batch divided by a count of the *whole* step, so the
    micro-batch results of one step add up to the full-batch value (`loss_normalizer` computes it):
      token_mean           sum_{i,t} x / normalizer, normalizer = loss tokens in the step (DAPO's
                           token-level loss; long responses weigh more).
      seq_mean_token_sum   sum_i (sum_t x) / normalizer, normalizer = sequences in the step.
      seq_mean_token_mean  sum_i (mean_t x) / normalizer, normalizer = sequences in the step (the
                           GRPO paper's per-sequence mean; short responses weigh more per token).
      constant             sum_{i,t} x / normalizer, normalizer = max_len * sequences in the step
                           (Dr. GRPO: a constant, so the length bias of the per-sequence mean goes).
    token_mean, seq_mean_token_sum and constant share the formula and differ only in the count.
    """
    if mode == "seq_mean_token_mean":
        per_seq_mean = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq_mean.sum() / normalizer
    if mode in AGG_MODES:
        return masked_sum(per_token, mask) / normalizer
    raise ValueError(f"unknown aggregation mode {mode!r}; valid: {', '.join(AGG_MODES)}")


def loss_normalizer(masks: Sequence[torch.Tensor], mode: str, max_len: int | None = None) -> float:
    """The `normalizer` for `aggregate` from the loss masks [b_k, T_k] of all micro-batches of a step.

    Sequences are counted only if they have at least one loss token (an empty one adds nothing to
    the sum, so it should not dilute the mean). "constant" needs `max_len`, the maximum response
    length. Clamped to >= 1 so an all-masked step gives loss 0, not NaN.
    """
    if mode == "token_mean":
        count = sum(float(m.sum()) for m in masks)
    elif mode in ("seq_mean_token_sum", "seq_mean_token_mean", "constant"):
        count = sum(float((m.sum(-1) > 0).sum()) for m in masks)
        if mode == "constant":
            if max_len is None:
                raise ValueError("aggregation mode 'constant' needs max_len")
            count *= max_len
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid: {', '.join(AGG_MODES)}")
    return max(count, 1.0)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg_mode: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with separate low / high clip ranges (DAPO).

    loss = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high)), r = exp(logp - old_logp).
    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"), on when
    `dual_clip_c` (> 1) is set: for A < 0 the loss is further capped at -A * c, because there the
    PPO max is unbounded in r and one stale token with a huge ratio would dominate the update.
    Metrics: `ppo_kl` = token-mean of (old_logp - logp); `pg_clipfrac` = share of tokens where the
    clipped term is the one taken; with dual clip, `pg_clipfrac_lower` = share of tokens capped by
    it. All are exactly 0 when logp equals old_logp.
    """
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c must be > 1 (got {dual_clip_c})")
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        capped = torch.minimum(per_token, -advantages * dual_clip_c)
        lower = (advantages < 0) & (capped < per_token)
        per_token = torch.where(advantages < 0, capped, per_token)
    loss = aggregate(per_token, mask, agg_mode, normalizer)
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "ppo_kl": aggregate(-log_ratio, mask, agg_mode, normalizer),
            "pg_clipfrac": aggregate((clipped > unclipped).float(), mask, agg_mode, normalizer),
        }
        if dual_clip_c is not None:
            metrics["pg_clipfrac_lower"] = aggregate(lower.float(), mask, agg_mode, normalizer)
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
