"""Building blocks shared by every family: RMSNorm and the SwiGLU MLP (RoPE lives in rope.py).

Numerics follow Qwen3: RMSNorm normalizes in float32 and casts back to the input dtype
before scaling by its weight. Nothing here depends on a fixed parameter dtype, so the same
code runs fp32, bf16 weights, or fp32 weights under autocast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.models import fused, fused_projections


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dimension. x: [..., dim]."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.ops["rms_norm"](x, self.weight, self.eps)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases. x: [..., hidden] -> [..., hidden]. Also one expert
    of a MoE layer; `ctx` is unused, it keeps the feed-forward call uniform (see blocks.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        gate, up = fused_projections.project(self, fused_projections.GATE_UP, x)
        return self.down_proj(fused.ops["silu_mul"](gate, up))


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding; built on the meta device (`with torch.device("meta")`: checkpoint loading, the
    planner's counts) without its normal_ init, which has no values to set there and whose meta kernel
    imports torch._dynamo: ~1 s of CPU in every process that loads a model (each Ray actor, each
    launch.py run), which nothing else on the CPU imports."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
    return nn.Embedding(num_embeddings, embedding_dim)
