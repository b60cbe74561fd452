"""Elementwise pieces of the decoder as swappable functions, compiled into fused kernels on a GPU.

A decode step of a small model is bound by kernel launches, not bytes: eager RMSNorm is ~7 kernels,
RoPE ~7 per tensor, SwiGLU's gate 2. `enable()` swaps in `torch.compile`d versions (Inductor fuses
each into one Triton kernel; dynamic shapes, so one compile serves every batch bucket). The math is
the same code, so the trainer (same process) and the engine keep computing the same function.
Never enabled on the CPU, where the eager versions stay (CPU numerics unchanged).

Each compiled op has its backward written out (`BACKWARD`, compiled too) and runs through `_Fused`,
whose forward is the inference kernel whether or not autograd records the call. Inductor compiles a
call that needs gradients into another forward kernel (its training graph), which rounded RMSNorm
otherwise than the no-grad kernel: a separate no-grad pass for the old log-probs then differed from
the training forward (first-step `train/ppo_kl` 1.5e-8, not 0, on an H100).
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


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(d x, d weight) of `rms_norm`, in float32 then cast to each input's dtype."""
    h = x.float()
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    n = h * r
    g = grad.float() * weight.to(x.dtype).float()  # d n (the cast to x's dtype passes gradients through)
    dx = r * (g - n * (g * n).mean(-1, keepdim=True))
    dw = (grad * n.to(x.dtype)).float().reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), None


def rotate_backward(grad: torch.Tensor, x: None, cos: torch.Tensor, sin: torch.Tensor):
    """d x of `rotate` (the tables are constants; x itself is not needed): grad * cos, plus the
    rotation's transpose of grad * sin."""
    cos, sin = cos[:, None].to(grad.dtype), sin[:, None].to(grad.dtype)
    g1, g2 = (grad * sin).chunk(2, dim=-1)
    return grad * cos + torch.cat((g2, -g1), dim=-1), None, None


def silu_mul_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(d gate, d up) of `silu_mul`, in float32 then cast."""
    g, u, dy = gate.float(), up.float(), grad.float()
    sig = torch.sigmoid(g)
    return (dy * u * sig * (1 + g * (1 - sig))).to(gate.dtype), (dy * g * sig).to(up.dtype)


BACKWARD = {"rms_norm": rms_norm_backward, "rotate": rotate_backward, "silu_mul": silu_mul_backward}
# The arguments each backward reads (the others reach it as None): RoPE's input is not kept alive.
SAVED = {"rms_norm": (0, 1), "rotate": (1, 2), "silu_mul": (0, 1)}


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
        ops[name] = _differentiable(name, torch.compile(fn, dynamic=True, fullgraph=True),
                                    torch.compile(BACKWARD[name], dynamic=True, fullgraph=True))


class _Fused(torch.autograd.Function):
    """forward(ctx, forward_fn, backward_fn, saved, *args): forward_fn on detached inputs (the kernel
    a no-grad call runs); backward_fn(grad, *args) gives one gradient per argument, the tensors not
    in `saved` (indices) passed as None."""

    @staticmethod
    def forward(ctx, forward_fn, backward_fn, saved, *args):
        ctx.backward_fn, ctx.saved = backward_fn, saved
        ctx.save_for_backward(*(args[i] for i in saved))
        ctx.constants = [None if isinstance(a, torch.Tensor) else a for a in args]
        return forward_fn(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))

    @staticmethod
    def backward(ctx, grad):
        args = list(ctx.constants)
        for i, t in zip(ctx.saved, ctx.saved_tensors):
            args[i] = t
        return (None, None, None, *ctx.backward_fn(grad.contiguous(), *args))


def _differentiable(name: str, forward_fn, backward_fn):
    def call(*args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return _Fused.apply(forward_fn, backward_fn, SAVED[name], *args)
        return forward_fn(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))  # as _Fused calls it
    call.__name__ = name
    return call

