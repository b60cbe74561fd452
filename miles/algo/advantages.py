"""Advantage estimators: per-sequence rewards [N] (grouped by `group_ids` [N]) -> advantages [N]."""

from __future__ import annotations

import torch

from miles.algo.registry import register_advantage


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and unbiased std of its group's rewards (std 0 for singleton groups)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, rewards)
    means = sums / counts
    sq = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    stds = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return means[inverse], stds[inverse]


@register_advantage("grpo")
def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (DeepSeekMath, eq. 3): A_i = (r_i - mean(group)) / (std(group) + eps).

    Without std normalization it is the group-mean baseline (Dr. GRPO's fix for the std bias).
    A group whose rewards are all equal gets advantage 0 (no learning signal).
    """
    rewards = rewards.to(torch.float32)
    mean, std = _group_stats(rewards, group_ids)
    centred = rewards - mean
    if not norm_by_std:
        return centred
    # A zero-variance group has centred == 0; keep it exactly 0 even with eps == 0.
    return torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
