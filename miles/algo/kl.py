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
