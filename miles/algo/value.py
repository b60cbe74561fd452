"""Critic math for PPO: the clipped value loss and explained variance.

Shapes: `values` (the critic's current predictions, differentiable), `old_values` (its predictions
when the rollout was scored, which GAE used), `returns` and `mask` are [B, T] over response tokens.
`normalizer` is the number of loss tokens of the whole optimizer step, as in `losses.aggregate`, so
micro-batches add up to the token mean of the step.
"""

from __future__ import annotations

import torch

from miles.algo.losses import masked_sum


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float,
    value_clip: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss (Schulman et al. 2017; the clipped form of OpenAI baselines, verl, OpenRLHF):

    loss = 0.5 * max((V - R)^2, (V_clip - R)^2),  V_clip = old_V + clip(V - old_V, -c, c).
    Clipping keeps one update from moving a value estimate further than `value_clip` from the one
    the advantages were computed with, as the policy clip does for the ratio; `value_clip=None` is
    the plain squared error. Token mean (over `normalizer` tokens).
    Metrics: `value_loss`; `vf_clipfrac` = share of tokens where the clipped term is the one taken
    (exactly 0 while V == old_V, i.e. on the first update of a batch).
    """
    unclipped = (values - returns) ** 2
    if value_clip is None:
        per_token, clipped_taken = unclipped, torch.zeros_like(unclipped)
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
        clipped = (clipped_values - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_taken = (clipped > unclipped).float()
    loss = 0.5 * masked_sum(per_token, mask) / normalizer
    with torch.no_grad():
        metrics = {"value_loss": loss.detach(), "vf_clipfrac": masked_sum(clipped_taken, mask) / normalizer}
    return loss, metrics


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[R - V] / Var[R] over the unmasked tokens: 1 is a perfect critic, 0 one no better than
    the mean return, negative one worse. Returns 0 when the returns do not vary (nothing to explain).
    """
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=1)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * mask).sum() / count
        return (((x - mean) * mask) ** 2).sum() / count

    var_returns = var(returns)
    if var_returns <= 0:
        return torch.zeros(())
    return 1 - var(returns - values) / var_returns
