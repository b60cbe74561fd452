"""Advantage estimators and reward shaping.

Sequence-level estimators (ADVANTAGES): per-sequence rewards [N] grouped by `group_ids` [N] ->
advantages [N]. The loop calls them as fn(rewards, group_ids, norm_by_std=...); estimators for which
std normalization means nothing take and ignore it (`**_`), as `nll_loss` does with the PPO kwargs.
GAE needs a critic and token-level inputs, so it lives in TOKEN_ADVANTAGES (see `registry`).
"""

from __future__ import annotations

import torch

from miles.algo.registry import register_advantage, register_token_advantage


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inverse [N], counts [G]): the dense group index of every sample and the size of every group."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def _constant_groups(rewards: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    """bool [N]: the sample's group has a single reward value (singleton groups included).

    Compared through max == min, not std == 0 or r == mean: the float mean of n equal non-dyadic
    values is in general not that value (fp32 mean of eight 0.7s misses by 6e-8), so "r - mean" of a
    constant group is tiny but non-zero, and a std division blows it up to a same-sign advantage.
    """
    hi = torch.full((n_groups,), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amax")
    lo = torch.full((n_groups,), torch.inf, dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amin")
    return (hi == lo)[inverse]


def _group_centred(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: r_i - mean(group(i)) and the group's unbiased std (0 for singletons), both exactly
    0 for constant groups (see `_constant_groups`)."""
    inverse, counts = _group_index(group_ids)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, rewards)
    means = sums / counts
    sq = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    stds = torch.sqrt(sq / (counts - 1).clamp(min=1))
    constant = _constant_groups(rewards, inverse, len(counts))
    zero = torch.zeros_like(rewards)
    return torch.where(constant, zero, rewards - means[inverse]), torch.where(constant, zero, stds[inverse])


def _batch_whiten(x: torch.Tensor, eps: float, centre: bool = True) -> torch.Tensor:
    """(x - mean) / (unbiased std + eps) over the whole batch; a constant batch (or N < 2) gives 0.

    centre=False skips the mean subtraction, for inputs whose mean is 0 by construction (group-centred
    rewards): subtracting their float mean (~1e-8, not 0) would move the exact zeros of constant groups.
    """
    if x.numel() < 2 or bool((x == x[0]).all()):
        # Tested exactly rather than through std > 0: the float mean of equal values can miss them.
        return torch.zeros_like(x)
    centred = x - x.mean() if centre else x
    return centred / (x.std() + eps)


@register_advantage("grpo")
def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (DeepSeekMath, eq. 3): A_i = (r_i - mean(group)) / (std(group) + eps).

    Without std normalization it is the group-mean baseline (Dr. GRPO's fix for the std bias).
    A group whose rewards are all equal gets advantage exactly 0 (no learning signal), whatever the
    reward values and dtype.
    """
    rewards = rewards.to(torch.float32)
    centred, std = _group_centred(rewards, group_ids)
    if not norm_by_std:
        return centred
    # Constant groups have centred == std == 0 exactly; the where keeps them 0 (not NaN) with eps == 0.
    return torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))


@register_advantage("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, **_: object) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean(group).

    The std division is the question-level difficulty bias the paper removes, so `norm_by_std` is
    ignored. Pair it with the "constant" loss aggregation to also remove the length bias.
    """
    return grpo_advantages(rewards, group_ids, norm_by_std=False)


@register_advantage("rloo")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, **_: object) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(group)).

    The leave-one-out baseline is independent of r_i, so the estimator stays unbiased. A singleton
    group has no other sample to form a baseline and gets 0, as does every group of equal rewards
    (exactly). `norm_by_std` is ignored.
    """
    rewards = rewards.to(torch.float32)
    inverse, counts = _group_index(group_ids)
    n = counts[inverse].to(rewards.dtype)
    centred, _ = _group_centred(rewards, group_ids)
    # A singleton is a constant group (centred exactly 0), so the clamp only avoids 1 / 0.
    return n / (n - 1).clamp(min=1) * centred


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, **_: object
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps).

    Global batch whitening, no group baseline: group ids are ignored, so it also works with one
    sample per prompt. Whitening already divides by a std, so `norm_by_std` is ignored.
    """
    return _batch_whiten(rewards.to(torch.float32), eps)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, **_: object
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): subtract the group mean, then whiten over the whole batch.

    A_i = c_i / (std_batch(c) + eps), c_i = r_i - mean(group(i)); the batch mean of c is already 0
    (so it is not subtracted again, which keeps constant groups at exactly 0 in a mixed batch).
    Uses the batch std instead of GRPO's per-group std, so low-variance groups are not amplified.
    """
    centred = grpo_advantages(rewards, group_ids, norm_by_std=False)
    return _batch_whiten(centred, eps, centre=False)


@register_advantage("none")
def no_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, **_: object) -> torch.Tensor:
    """No reward signal: all zeros. On-policy distillation (`algo=opd`) learns from the teacher's
    per-token reverse KL alone, which the trainer adds to these advantages."""
    return torch.zeros_like(rewards, dtype=torch.float32)


@register_token_advantage("gae")
@torch.no_grad()  # advantages and returns are regression / policy-gradient targets, never differentiated
def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016, eq. 16) for a PPO critic: [B, T] rewards, values, mask -> (A, returns).

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1},  returns = A + V,
    where t + 1 is the next *unmasked* token (masked tokens, e.g. tool outputs inside a multi-turn
    response, are skipped, not treated as steps) and V, A after the last unmasked token are 0 (the
    episode ends). The sequence reward usually sits on the last response token. Masked positions
    get advantage and return 0. Whitening the advantages, if wanted, is the caller's choice.
    """
    token_rewards, values, mask = token_rewards.float(), values.float(), mask.float()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        keep = mask[:, t] > 0
        advantages[:, t] = torch.where(keep, adv, torch.zeros_like(adv))
        next_value = torch.where(keep, values[:, t], next_value)
        next_adv = torch.where(keep, adv, next_adv)
    return advantages, (advantages + values) * mask


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence rewards [N] placed on the last unmasked token of each row of `mask` [N, T] -> [N, T].

    The reward of a response arrives when it ends, which is where GAE expects it; a row without
    loss tokens gets nothing.
    """
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(-1).values  # [N]
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has_tokens = last >= 0
    out[has_tokens, last[has_tokens]] = rewards.to(torch.float32)[has_tokens]
    return out


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the unmasked tokens of the whole batch, 0 outside the mask:
    [N, T] -> [N, T]. `var` is the unbiased (n - 1) variance, as in verl's `masked_whiten`, so
    x = [1, 2, 3] gives [-1, 0, 1].

    PPO whitens GAE advantages per batch (as verl and OpenRLHF do) so the step size does not depend
    on the reward scale or on how well the critic fits. Equal values under the mask (one token
    included) give exactly 0: their float mean can miss them, and rsqrt(eps) would magnify the miss.
    """
    inside = mask > 0
    mask = mask.to(x.dtype)
    count = mask.sum()
    mean = (x * mask).sum() / count.clamp(min=1)
    var = (((x - mean) * mask) ** 2).sum() / (count - 1).clamp(min=1)
    hi = x.masked_fill(~inside, -torch.inf).amax()
    lo = x.masked_fill(~inside, torch.inf).amin()
    # hi <= lo: no token (hi = -inf) or a single value; a where, not an if, so no host sync on a GPU.
    return torch.where(hi <= lo, torch.zeros_like(x), (x - mean) * torch.rsqrt(var + eps) * mask)


def clip_rewards(rewards: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Clamp rewards to [low, high] so one outlier reward cannot dominate the batch statistics."""
    return rewards.clamp(min=low, max=high)


def overlong_penalty(response_lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, sec. 3.4), added to the reward: [N] -> [N].

    0 for len <= max_len - cache_len; ((max_len - cache_len) - len) / cache_len in the cache interval
    (linear from 0 to -1); -1 beyond max_len. cache_len == 0 is a hard cutoff at max_len.
    """
    excess = (response_lengths.float() - (max_len - cache_len)).clamp(min=0)
    if cache_len == 0:
        return -(excess > 0).float()
    return -(excess / cache_len).clamp(max=1.0)


def keep_groups_with_variance(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): bool mask [N] of samples to keep.

    Drops every group whose rewards are all equal (all correct or all wrong, including singleton
    groups): their group-baseline advantages are 0, so they only dilute the batch.
    """
    inverse, counts = _group_index(group_ids)
    # The same exact test as the advantages use, so a dropped group is exactly a zero-advantage one.
    return ~_constant_groups(rewards.to(torch.float32), inverse, len(counts))
