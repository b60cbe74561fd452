"""Grouped-query self-attention with optional QK-norm, plus the KV cache used for decoding.

One `Attention.forward` serves both paths:
  * training / full forward: `cache=None`, the T new tokens attend to each other;
  * incremental decode: the T new keys/values are written into `cache` at
    `cache.length` and the queries attend to everything cached so far.
Which keys a query may see is decided entirely by the boolean mask the caller
(`CausalLM`) builds, so both paths run the same math and produce the same logits.

Shapes: x [B, T, hidden]; q [B, H, T, D]; k, v [B, Hkv, S, D] with S = keys visible
(T without cache, cache.length + T with it); mask [B, 1, T, S], True = may attend.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.config import ArchConfig
from miles.models.layers import RMSNorm, apply_rope


class KVCache:
    """Preallocated keys/values for every layer: lists of [B, Hkv, max_len, D] tensors.

    Positions [0, length) hold valid entries; all rows of the batch share `length`
    (the rollout engine left-pads prompts so that they end at the same column).
    `CausalLM.forward` writes each layer's new entries via `update` and then calls
    `advance` once, after the last layer.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys = keys
        self.values = values
        self.length = 0

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> "KVCache":
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys, values)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v: [B, Hkv, T, D] at [length, length + T); return all keys/values so far
        ([B, Hkv, length + T, D], views into the cache). Does not advance `length`."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions needed, max_len is {self.max_len}")
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def select(self, index: torch.Tensor) -> "KVCache":
        """Keep / reorder batch rows in place: row i becomes old row index[i]. index: LongTensor [B'].
        The caller must select the same rows of its attention mask."""
        self.keys = [k[index] for k in self.keys]
        self.values = [v[index] for v in self.values]
        return self


class Attention(nn.Module):
    """GQA attention: H query heads share H/Hkv key/value heads. Parameter names match HF
    (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm)."""

    def __init__(self, cfg: ArchConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # which cache slot this layer reads and writes
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        # Qwen3 normalizes each head's q and k (over head_dim) before RoPE; Qwen2 does not.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """x: [B, T, hidden]; cos/sin: [B, T, D] (float32); mask: bool [B, 1, T, S].
        Returns [B, T, hidden]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
            # The cache may be stored in another dtype than the compute (e.g. under autocast).
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
