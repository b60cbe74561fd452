"""Rotary position embedding: frequencies (plain or scaled), cos / sin tables, application.

Layout is HF's "rotate half": within the rotated width, dimension j is paired with j + dim/2 and
both share frequency j. With partial rotary (GLM-4.5, Qwen3-Next) only the first `rotary_dim`
dims of each head rotate; the rest pass through. Angles, cos and sin are computed in float32 and
cast to the dtype of q / k only when applied. There is no cached buffer, so `model.to(dtype)` or
meta-device construction cannot degrade or lose a table.
"""

from __future__ import annotations

import torch

from miles.models.config import RopeScalingConfig


def inv_freq(dim: int, theta: float, scaling: RopeScalingConfig | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] float32, attention factor multiplying cos and sin)."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if scaling is None:
        return base, 1.0
    raise ValueError(f"rope_scaling.type {scaling.type!r} is not implemented")


def rope_cos_sin(position_ids: torch.Tensor, dim: int, theta: float,
                 scaling: RopeScalingConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for the given positions, float32. position_ids: [B, T] (absolute, so left padding
    and decode steps need no special casing). Returns (cos, sin), each [B, T, dim]."""
    freq, factor = inv_freq(dim, theta, scaling)
    angles = position_ids[..., None].float() * freq.to(position_ids.device)  # [B, T, dim/2]
    angles = torch.cat((angles, angles), dim=-1)  # both halves of a pair share a frequency
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x: [B, H, T, D] by cos / sin: [B, T, rotary_dim].
    Keeps x's dtype; dims past rotary_dim pass through unchanged."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # broadcast over heads
    x_rot, x_pass = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    x1, x2 = x_rot.chunk(2, dim=-1)
    out = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if x_pass is None else torch.cat((out, x_pass), dim=-1)
