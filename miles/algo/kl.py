"""KL estimators between the policy and a reference, per token (Schulman, "Approximating KL").

All take log-probs of the sampled tokens under the policy and the reference, shape [B, T], and
return a per-token estimate of KL(policy || reference), shape [B, T].
"""

from __future__ import annotations

import torch

from miles.algo.registry import register_kl


@register_kl("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """log(pi / ref): unbiased, can be negative per token."""
    return logp - ref_logp


@register_kl("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """ref/pi - 1 - log(ref/pi): unbiased and non-negative (GRPO's choice)."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


@register_kl("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """0.5 * (log(pi / ref))^2: biased, low-variance, non-negative; on samples from pi its expected
    gradient is the gradient of KL(pi || ref), which is why it works as a loss term."""
    return 0.5 * (logp - ref_logp) ** 2


@register_kl("low_var_kl")
def kl_low_var(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 made safe for training, as verl's "low_var_kl": log-ratio clamped to [-20, 20], k3 to <= 10.

    One token whose reference log-prob is far below the policy's makes exp(ref - logp) overflow or
    dwarf the rest of the batch; the clamps bound both. verl clamps k3 to [-10, 10], but k3 >= 0, so
    only the upper bound can act.
    """
    log_ratio = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, max=10.0)
