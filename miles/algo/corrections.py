"""Corrections for the mismatch between the rollout engine and the trainer.

The engine samples with its own kernels (and often another dtype), so its log-probs `rollout_logp`
differ from the trainer's `old_logp` for the same policy: the batch is slightly off-policy even on
the first step. Both functions take [B, T] log-probs of the sampled tokens and a loss mask [B, T],
look at the ratio pi_old / pi_rollout = exp(old_logp - rollout_logp), and return constants (no
gradient) that the caller multiplies into the per-token policy loss (weights) or the loss mask.
level="token" uses each token's ratio; level="sequence" uses the sequence's ratio, exp of the sum of
its tokens' log-ratios, broadcast to its tokens. Metrics are token means over `mask` of what was
passed in: call them once per rollout batch, as `train_rl` does for the mismatch metric.
`ratio_stats` reports the token-level ratios themselves, with or without a correction.
"""

from __future__ import annotations

import math

import torch

LEVELS = ("token", "sequence")


def _log_ratio(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """log(pi_old / pi_rollout) per token or per sequence (broadcast), [B, T]; 0 outside the mask."""
    # where, not a product: padded positions may hold log-probs whose difference is not finite.
    log_ratio = torch.where(mask > 0, old_logp - rollout_logp, torch.zeros_like(old_logp))
    if level == "token":
        return log_ratio
    if level == "sequence":
        return log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    raise ValueError(f"unknown level {level!r}; valid: {', '.join(LEVELS)}")


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def ratio_stats(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token-level ratios pi_old / pi_rollout over `mask`: `ratio_mean`, `ratio_std` (population),
    `ratio_min`, `ratio_max`; 1, 0, 1, 1 when the mask is empty. Over tokens the engine sampled, the
    ratio's expectation is 1 whatever the mismatch (sum_y pi_old(y) = 1): the mismatch shows in the
    spread and the tails, which TIS clips and MIS drops."""
    ratio = torch.exp(_log_ratio(old_logp, rollout_logp, mask, "token"))
    inside = mask > 0
    any_token, one = inside.any(), torch.ones((), dtype=ratio.dtype, device=ratio.device)
    mean = _token_mean(ratio, mask)
    return {"ratio_mean": torch.where(any_token, mean, one),
            "ratio_std": _token_mean((ratio - mean) ** 2, mask).sqrt(),
            "ratio_min": torch.where(any_token, ratio.masked_fill(~inside, math.inf).amin(), one),
            "ratio_max": torch.where(any_token, ratio.masked_fill(~inside, -math.inf).amax(), one)}


@torch.no_grad()
def tis_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    clip_high: float = 2.0,
    clip_low: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"): w = clamp(pi_old / pi_rollout, clip_low, clip_high), [B, T].

    Truncation trades a little bias for bounded variance: a token the engine found much less likely
    than the trainer cannot blow up the update. Masked positions get weight 1 (neutral).
    Metrics: `tis_mean` (mean weight), `tis_clipfrac` (share of tokens whose weight was truncated).
    """
    ratio = torch.exp(_log_ratio(old_logp, rollout_logp, mask, level))
    weights = torch.clamp(ratio, clip_low, clip_high)
    metrics = {
        "tis_mean": _token_mean(weights, mask),
        "tis_clipfrac": _token_mean((weights != ratio).float(), mask),
    }
    return weights, metrics


@torch.no_grad()
def mis_mask(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked importance sampling (IcePop, Ling team 2025): the loss mask [B, T] with every token (or,
    at level="sequence", every sequence) whose ratio pi_old / pi_rollout is outside [low, high] zeroed.

    Unlike TIS it drops such tokens entirely instead of keeping them with a capped weight: a large
    mismatch signals an engine/trainer disagreement whose gradient is noise, not a rare token.
    Metric: `mis_maskfrac` = share of the tokens of `mask` that were masked out.
    """
    ratio = torch.exp(_log_ratio(old_logp, rollout_logp, mask, level))
    inside = (ratio >= low) & (ratio <= high)
    new_mask = mask * inside.to(mask.dtype)
    return new_mask, {"mis_maskfrac": _token_mean((~inside).float(), mask)}
