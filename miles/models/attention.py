"""GQA attention (Qwen2 / Qwen3 / GLM-4.5 / MiniMax style): H query heads share H/Hkv key/value heads.

Options from the ArchConfig: QK-norm before RoPE, either per head (`qk_norm_type: head`, RMSNorm
over head_dim with one [head_dim] weight: Qwen3, GLM-4.5) or over the whole projection
(`qk_norm_type: full`, RMSNorm over all heads' q (resp. k) at once with a [heads * head_dim]
weight: MiniMax-M2); q/k/v bias; partial rotary (only the first rotary_dim dims of a head rotate,
rotate-half layout within them, as HF GLM-4.5 / MiniMax-M2). Parameter names match HF (q_proj,
k_proj, v_proj, o_proj, q_norm, k_norm). The same forward serves training (no cache) and decoding
(keys / values appended to this layer's KVBuffer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.models import decode_attention, fused_projections, invariant
from miles.models.cache import KVBuffer
from miles.models.config import ArchConfig
from miles.models.context import ForwardContext
from miles.models.layers import RMSNorm
from miles.models.rope import apply_rope, mrope_cos_sin, rope_cos_sin


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # which cache slot this layer reads and writes
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.rotary_dim, self.rope_theta, self.rope_scaling = cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling
        self.mrope_section, self.mrope_interleaved = cfg.mrope_section, cfg.mrope_interleaved
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        # Qwen3 normalizes each head's q and k (over head_dim) before RoPE; Qwen2 does not;
        # MiniMax-M2 normalizes the full q and k projections (statistics across heads).
        self.full_qk_norm = cfg.qk_norm_type == "full"
        q_norm_dim, k_norm_dim = (q_dim, kv_dim) if self.full_qk_norm else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_norm_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_norm_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> KVBuffer:
        return KVBuffer(batch, self.num_kv_heads, max_len, self.head_dim, self.head_dim, dtype, device)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]."""
        b, t, _ = x.shape
        q, k, v = fused_projections.project(self, fused_projections.QKV, x)
        if self.full_qk_norm and self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # [B, T, heads * D]: one norm across heads
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if not self.full_qk_norm and self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, over head_dim
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if ctx.mrope_position_ids is not None:
            cos, sin = ctx.memo(("mrope", self.rotary_dim, self.rope_theta),
                                lambda: mrope_cos_sin(ctx.mrope_position_ids, self.rotary_dim, self.rope_theta,
                                                      self.mrope_section, self.mrope_interleaved))
        else:
            cos, sin = ctx.memo(("rope", self.rotary_dim, self.rope_theta, id(self.rope_scaling)),
                                lambda: rope_cos_sin(ctx.position_ids, self.rotary_dim, self.rope_theta,
                                                     self.rope_scaling))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache = ctx.layer_cache(self.layer_idx)
        if cache is not None:
            k, v = cache.update(ctx.past, k, v)
            # The cache may be stored in another dtype than the compute (e.g. under autocast).
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = attend(q, k, v, ctx, self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, gqa: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over what ctx lets each query see. q: [B, H, T, D], k / v:
    [B, Hkv, S, D] -> [B, H, T, D]. The kernel follows the layout: slot decode reads each KV head
    once for its whole query group; packed rows go to miles.models.packed; unpadded, uncached rows
    on a GPU take SDPA's is_causal (flash kernels); everything else an explicit boolean mask."""
    if ctx.slot_decode:
        if q.shape[2] > 1:  # speculative verify: k + 1 queries per row
            return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask(), enable_gqa=gqa)
        if decode_attention.applies(q, k):  # CUDA: only each row's live columns (module doc)
            return decode_attention.slot_decode_attention(q, k, v, ctx.past)
        return grouped_decode_attention(q, k, v, ctx.mask())
    if invariant.active():  # one masked kernel for every layout (packed rows included)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask(), enable_gqa=gqa)
    if ctx.segment_ids is not None:
        from miles.models.packed import packed_attention

        return packed_attention(q, k, v, ctx, gqa)
    if ctx.plain_causal and q.is_cuda:  # on the CPU the masked kernel stays: unchanged numerics there
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask(), enable_gqa=gqa)


def grouped_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One new query per row: q [B, H, 1, D], k / v [B, Hkv, S, D], mask [B, 1, 1, S].

    The H / Hkv query heads that share a KV head become that head's query rows, so the keys and
    values are read once, without expanding them to H heads (HF's repeat_kv order: query head h
    uses KV head h // (H / Hkv))."""
    b, h, _, d = q.shape
    hkv = k.shape[1]
    grouped = q.reshape(b, hkv, h // hkv, d)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)  # [B, Hkv, H/Hkv, D]
    return out.reshape(b, h, 1, d)
