"""Elementwise pieces of the decoder as swappable functions, compiled into fused kernels on a GPU.

A decode step of a small model is bound by kernel launches, not bytes: eager RMSNorm is ~7 kernels,
RoPE ~7 per tensor, SwiGLU's gate 2. `enable()` swaps in `torch.compile`d versions (Inductor fuses
each into one Triton kernel; dynamic shapes, so one compile serves every batch bucket). The math is
the same code, so the trainer (same process) and the engine keep computing the same function.
Never enabled on the CPU, where the eager versions stay (CPU numerics unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.models import invariant


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In x's dtype, as with weights held in it: fp32 master weights under autocast are cast to it
    (the engine's bf16 arithmetic; an fp32 weight would promote the output, and every matmul after
    it would cast it back)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of all of x's last dim: x [B, H, T, D], cos / sin [B, T, D] (float32)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


EAGER = {"rms_norm": rms_norm, "rotate": rotate, "silu_mul": silu_mul}


class _Ops(dict):
    """The eager versions inside batch-invariant kernels (true on-policy), whose fixed reduction
    order a compiled kernel would not keep."""

    def __getitem__(self, name):
        return EAGER[name] if invariant.active() else super().__getitem__(name)


ops = _Ops(EAGER)  # what the modules call: ops["rms_norm"](...)


def enable() -> None:
    """Compiled versions from now on, in this process (idempotent)."""
    if ops["rms_norm"] is not EAGER["rms_norm"]:
        return
    # One compiled variant per dtype / rank / grad mode / eps of each call site family (engine,
    # trainer, QK-norm, ...) and model: a process that builds several models (a Hydra multirun, the
    # GPU test session) passed 64 and failed hard (fullgraph) at its next new variant.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 8192)
    for name, fn in EAGER.items():
        ops[name] = torch.compile(fn, dynamic=True, fullgraph=True)

