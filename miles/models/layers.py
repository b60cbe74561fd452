"""Building blocks of the Qwen-style decoder: RMSNorm, rotary position embedding, SwiGLU MLP.

Numerics follow Qwen3: RMSNorm normalizes in float32 and casts back to the input dtype
before scaling by its weight; RoPE angles, cos and sin are computed in float32 and cast
to the dtype of q/k only when applied. Nothing here depends on a fixed parameter dtype,
so the same code runs fp32, bf16 weights, or fp32 weights under autocast.

RoPE uses the "rotate half" layout of HF Qwen checkpoints: dimension j is paired with
j + head_dim/2 (not with its neighbour), and both halves share frequency j.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dimension. x: [..., dim]."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for the given positions, float32.

    position_ids: LongTensor [B, T] (absolute positions, so left padding and decode
    steps need no special casing). Returns (cos, sin), each [B, T, head_dim].
    Computed once per forward and shared by every layer; there is no cached buffer,
    so model.to(dtype) or meta-device construction cannot degrade or lose the table.
    """
    exponent = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [head_dim/2]
    angles = position_ids[..., None].float() * inv_freq  # [B, T, head_dim/2]
    angles = torch.cat((angles, angles), dim=-1)  # both halves of a pair share a frequency
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [B, H, T, head_dim] by the angles of cos/sin: [B, T, head_dim]. Keeps x's dtype."""
    cos = cos[:, None].to(x.dtype)  # broadcast over heads
    sin = sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases. x: [..., hidden] -> [..., hidden]."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
