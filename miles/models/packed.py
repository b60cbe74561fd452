"""Attention over packed rows: several sequences per row, each token sees only its own sequence.

`segment_ids` [B, T] (0 = padding) comes from the trainer's packer; q: [B, H, T, D], k / v:
[B, Hkv, T, D] -> [B, H, T, D]. Two kernels:
- CUDA, bf16 / fp16: `torch.nn.attention.varlen.varlen_attn` (FlashAttention's variable-length
  kernel) over the rows flattened to [B * T, heads, D]; each sequence, and each row's padded tail,
  is one causal block given by cumulative lengths `cu_seqlens`. The cost is sum_i len_i^2, not
  B * T^2, and no mask is built. GQA goes to the kernel as it is (FlashAttention reads each KV head
  for its whole query group, forward and backward).
- elsewhere (CPU, fp32): SDPA with the block-diagonal causal mask of `ForwardContext.mask`.

The trainer knows the layout on the host and hands it over with `varlen_layout(...)` around the
model call, so no host sync is needed; without it the layout is derived from `segment_ids` once
per forward (one sync). Either way it is memoized in the forward's context, which activation
checkpointing's recomputation reuses.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from miles.models.context import ForwardContext

# (cu_seqlens int32 [S + 1] on the device, max sequence length) of the next packed forward.
_LAYOUT: contextvars.ContextVar[Optional[tuple[torch.Tensor, int]]] = contextvars.ContextVar("varlen_layout",
                                                                                              default=None)


@contextlib.contextmanager
def varlen_layout(cu_seqlens: torch.Tensor, max_seqlen: int):
    """Packed forwards inside this block take their sequence boundaries from here: `cu_seqlens` the
    row-major cumulative lengths of every sequence and padded row tail (int32, on the model's
    device), `max_seqlen` the longest of them (a host int: the kernel's grid size)."""
    token = _LAYOUT.set((cu_seqlens, max_seqlen))
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def uses_varlen(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether packed rows on this device / compute dtype take the variable-length kernel
    (FlashAttention: CUDA, half precision, head_dim a multiple of 8 up to 256)."""
    return (torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and head_dim % 8 == 0 and head_dim <= 256 and _varlen_attn() is not None)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, gqa: bool) -> torch.Tensor:
    # Under autocast q / k can arrive in fp32 (QK-norm scales by fp32 master weights); SDPA's
    # autocast rule casts its inputs to the autocast dtype, and so does this (a custom op has none).
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    if ctx.branch_ids is not None or not uses_varlen(q.device, dtype, q.shape[-1]):  # shared prompts: a mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask(), enable_gqa=gqa)
    b, h, t, d = q.shape
    cu_seqlens, max_seqlen = ctx.memo(("varlen",), lambda: _LAYOUT.get() or layout_from_segments(ctx.segment_ids))
    # [B * T, heads, D], cast and made contiguous in one copy
    # (reshape copies when the transpose left x strided, e.g. bf16 inputs that need no cast)
    flat = [x.transpose(1, 2).to(dtype).reshape(b * t, x.shape[1], d) for x in (q, k, v)]
    kernel = _varlen_attn()
    if gqa and not _takes_enable_gqa(kernel):  # torch < 2.13: the kernel wants as many KV heads as q heads
        flat[1], flat[2] = (x.repeat_interleave(h // x.shape[1], dim=1) for x in flat[1:])
    extra = {"enable_gqa": True} if gqa and _takes_enable_gqa(kernel) else {}
    out = kernel(*flat, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **extra, **_causal_kwargs())
    return out.view(b, t, h, d).transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _takes_enable_gqa(kernel) -> bool:
    return "enable_gqa" in inspect.signature(kernel).parameters


def layout_from_segments(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, max_seqlen) of packed rows [B, T]: a block starts at every row start and wherever
    the segment id changes (a row's padded tail, id 0, is a block of its own). Syncs once."""
    b, t = segment_ids.shape
    flat = segment_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::t] = True
    bounds = torch.cat([starts.nonzero().squeeze(1), flat.new_tensor([b * t])]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())


@functools.lru_cache(maxsize=None)
def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.lru_cache(maxsize=None)
def _causal_kwargs() -> dict:
    """torch 2.10 spelled causality `is_causal=True`; later versions a window of (-1, 0). Asked on first
    use, not at import: torch.nn.attention.varlen imports torch._dynamo (~0.9 s a process, on the CPU
    in every Ray actor and launch.py run, where the kernel never runs)."""
    fn = _varlen_attn()
    if fn is None:
        return {}
    return {"is_causal": True} if "is_causal" in inspect.signature(fn).parameters else {"window_size": (-1, 0)}

