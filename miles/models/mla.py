"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash; the base of DSA).

Keys and values of all heads are generated from one small per-token latent, which is all the
decode cache has to hold:

  q:      x -> q_a_proj -> q_a_layernorm -> q_b_proj      (q_lora_rank > 0; else one q_proj)
          -> per head [q_nope (qk_nope_head_dim) | q_rope (qk_rope_head_dim)], RoPE on q_rope
  latent: x -> kv_a_proj_with_mqa -> [c (kv_lora_rank) | k_rope (qk_rope_head_dim)]
          c -> kv_a_layernorm;  RoPE on k_rope (one head, shared by all query heads)
  k, v:   c -> kv_b_proj -> per head [k_nope | v];  k = [k_nope | k_rope]
  out:    softmax(q k^T * scale) v -> o_proj,  scale = qk_head_dim^-0.5 * YaRN mscale^2

Cache layout (`MLACache`): [B, max_len, kv_lora_rank + qk_rope_head_dim] = normalized latent and
the already-rotated k_rope. Training, prefill and the padded engine's decode re-expand the cached
latent through kv_b_proj every call. Slot decode (the cache rows are slots with lengths of their own,
miles/models/cache.py's SlotCache) takes the weight-absorbed form for its one-token steps
(miles/models/mla_decode.py: kv_b_proj folded into the query and the output, the cache read once per
step as stored; DSA's SparseMLAttention too, under its kept-keys mask: `attend_latent`); speculative
verify steps (several tokens per row), a kv_b_proj that is quantized or carries LoRA hooks, and
batch-invariant kernels (true on-policy) keep the expanded form, over the slot mask.

RoPE layout: DeepSeek checkpoints store each rotary width as adjacent pairs (x0, x1), (x2, x3)...
(`mla.rope_interleave`, transformers' default for these families). We de-interleave q_rope and
k_rope to the rotate-half layout [even dims | odd dims] and use the shared `apply_rope`; both q and
k are permuted alike, so the scores are those of the interleaved rotation (bit-identical to HF).

The forward is split in pieces so that sparse variants (DSA) can reuse them: `query` (q and the
q latent the DSA indexer reads), `latent_kv`, `expand_kv`, `attend` (any boolean mask).
Parameter names match HF's DeepseekV3Attention.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from miles.models import invariant
from miles.models.config import ArchConfig
from miles.models.context import ForwardContext
from miles.models.layers import RMSNorm
from miles.models.mla_decode import absorbed_attention
from miles.models.rope import apply_rope, rope_cos_sin, softmax_scale_factor

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not
# config.rms_norm_eps (DeepSeek's reference code does the same); GLM-4.7-Flash's 1e-5 does not apply.
LATENT_NORM_EPS = 1e-6


class MLACache:
    """Compressed decode state of one MLA layer: kv [B, max_len, kv_lora_rank + rope_dim] holding
    the normalized KV latent followed by the rotated shared rope key, per position."""

    def __init__(self, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int, dtype, device):
        self.kv_lora_rank = kv_lora_rank
        self.kv = torch.zeros(batch, max_len, kv_lora_rank + rope_dim, dtype=dtype, device=device)

    def update(self, start: int | torch.Tensor, latent: torch.Tensor,
               k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write latent [B, T, R] and k_rope [B, T, r] at [start, start + T); return all cached
        (latent [B, start + T, R], k_rope [B, start + T, r]), views into the buffer. Slot decode:
        start [B] is each row's column (its T new columns follow it), and the whole buffer comes
        back (the slot mask hides unwritten columns)."""
        if isinstance(start, torch.Tensor):
            # An index put does not cast (a slice copy does): the inputs may be in the autocast dtype.
            new = torch.cat((latent, k_rope), dim=-1).to(self.kv.dtype)
            rows = torch.arange(new.shape[0], device=new.device)[:, None]
            cols = start[:, None] + torch.arange(new.shape[1], device=new.device)[None, :]
            self.kv[rows, cols] = new
            return self.kv[..., :self.kv_lora_rank], self.kv[..., self.kv_lora_rank:]
        end = start + latent.shape[1]
        if end > self.kv.shape[1]:
            raise ValueError(f"MLA cache overflow: {end} positions needed, max_len is {self.kv.shape[1]}")
        self.kv[:, start:end, :self.kv_lora_rank] = latent
        self.kv[:, start:end, self.kv_lora_rank:] = k_rope
        return self.kv[:, :end, :self.kv_lora_rank], self.kv[:, :end, self.kv_lora_rank:]

    def select(self, index: torch.Tensor) -> None:
        self.kv = self.kv[index]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The buffers, rows first (what slot compaction moves and the memory report counts)."""
        return (self.kv,)

    def first_rows(self, b: int) -> "MLACache":
        """A view of rows [0, b): same storage, so a graph captured on it sees later writes."""
        view = copy.copy(self)
        view.kv = self.kv[:b]
        return view

    def copy_rows(self, dst: torch.Tensor, src: "MLACache", src_rows: torch.Tensor, width: int) -> None:
        """Rows dst of this buffer take columns [0, width) of src's rows src_rows (prefill -> slots)."""
        self.kv[dst, :width] = src.kv[src_rows, :width]


class MLAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int):
        super().__init__()
        m = cfg.mla
        self.layer_idx = layer_idx  # which cache slot this layer reads and writes
        self.num_heads = cfg.num_heads
        self.q_lora_rank, self.kv_lora_rank = m.q_lora_rank, m.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        self.rope_interleave = m.rope_interleave
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        # DeepSeek's YaRN keeps the softmax temperature right by squaring mscale into the scale.
        self.scale = self.qk_dim ** -0.5 * softmax_scale_factor(cfg.rope_scaling)
        hidden, heads, bias = cfg.hidden_size, cfg.num_heads, cfg.attention_bias
        if m.q_lora_rank > 0:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, heads * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * m.v_head_dim, hidden, bias=bias)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> MLACache:
        return MLACache(batch, max_len, self.kv_lora_rank, self.rope_dim, dtype, device)

    # -- pieces ------------------------------------------------------------------------------

    def rope(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Rotate x: [B, H, T, rope_dim] at ctx's positions (output in rotate-half layout)."""
        cos, sin = ctx.memo(("rope", self.rope_dim, self.rope_theta, id(self.rope_scaling)),
                            lambda: rope_cos_sin(ctx.position_ids, self.rope_dim, self.rope_theta,
                                                 self.rope_scaling))
        if self.rope_interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    def query(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x: [B, T, hidden] -> (q [B, H, T, qk_dim] with RoPE applied to its last rope_dim dims,
        q latent [B, T, q_lora_rank] after q_a_layernorm (what DSA's indexer reads; None without
        q compression))."""
        b, t, _ = x.shape
        if self.q_lora_rank > 0:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        else:
            q_latent, q = None, self.q_proj(x)
        q = q.view(b, t, self.num_heads, self.qk_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return torch.cat((q_nope, self.rope(q_rope, ctx)), dim=-1), q_latent

    def latent_kv(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, hidden] -> (normalized KV latent [B, T, kv_lora_rank], rotated shared key
        [B, T, rope_dim]): exactly what the cache stores."""
        b, t, _ = x.shape
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = self.rope(k_rope.view(b, 1, t, self.rope_dim), ctx).view(b, t, self.rope_dim)
        return self.kv_a_layernorm(latent), k_rope

    def expand_kv(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, S, R], k_rope [B, S, r] -> (k [B, H, S, qk_dim], v [B, H, S, v_dim])."""
        b, s, _ = latent.shape
        kv = self.kv_b_proj(latent).view(b, s, self.num_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = k_rope[:, None].expand(b, self.num_heads, s, self.rope_dim)
        return torch.cat((k_nope, k_rope), dim=-1), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Scaled dot-product attention. q [B, H, T, qk_dim], k [B, H, S, qk_dim], v [B, H, S, v_dim],
        mask bool [B|1, 1|H, T, S] (True = may attend) -> [B, H, T, v_dim]."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

    # -- the layer ---------------------------------------------------------------------------

    def absorbs(self, ctx: ForwardContext) -> bool:
        """Whether this call takes the absorbed decode: one token per row over a slot cache, with
        kv_b_proj a plain Linear (its weight is the math; a quantized layer or LoRA hooks change
        what the layer computes) and without batch-invariant kernels (which fix the trainer's
        expanded reduction order)."""
        proj = self.kv_b_proj
        return (ctx.slot_decode and ctx.t == 1 and type(proj) is nn.Linear and not proj._forward_hooks
                and not proj._forward_pre_hooks and not invariant.active())

    def attend_latent(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, cache: Optional[MLACache],
                      ctx: ForwardContext, mask: torch.Tensor) -> torch.Tensor:
        """Attention of q [B, H, T, qk_dim] over latent / k_rope (what `cache.update` returned, or this
        call's own without a cache) under mask [B|1, 1, T, S] -> [B, H, T, v_dim]: absorbed where
        `absorbs` says so, else expanded through kv_b_proj."""
        if self.absorbs(ctx):  # slot decode: the cache rows as stored, [latent | k_rope] per column
            return absorbed_attention(q, cache.kv.to(q.dtype), mask, self.kv_b_proj.weight, self.nope_dim, self.scale)
        if cache is not None:  # the cache may be stored in another dtype than the compute (autocast)
            latent, k_rope = latent.to(q.dtype), k_rope.to(q.dtype)
        k, v = self.expand_kv(latent, k_rope)
        return self.attend(q, k, v, mask)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]."""
        b, t, _ = x.shape
        q, _ = self.query(x, ctx)
        latent, k_rope = self.latent_kv(x, ctx)
        cache = ctx.layer_cache(self.layer_idx)
        if cache is not None:
            latent, k_rope = cache.update(ctx.past, latent, k_rope)
        out = self.attend_latent(q, latent, k_rope, cache, ctx, ctx.mask())
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.v_dim))
