"""Decoder-only causal language model (Qwen3 / Qwen2 architecture) built from an ArchConfig.

Layout (parameter names equal HF's minus the leading "model."; see hf_io for the table):
  embed_tokens -> layers[i] (pre-norm: x + attn(norm(x)), then h + mlp(norm(h))) -> norm -> lm_head.
With tie_word_embeddings there is no lm_head module: logits use embed_tokens.weight, so
the state dict holds the shared matrix once and tying survives any load or dtype cast.

The same `forward` serves training (no cache) and rollout decoding (with a KVCache); the
boolean attention mask built here is the only difference between the two, which is what
makes prefill + token-by-token decode reproduce the full-forward logits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.attention import Attention, KVCache
from miles.models.config import ArchConfig
from miles.models.layers import RMSNorm, SwiGLUMLP, rope_cos_sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: Optional[KVCache] = None) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]; see Attention.forward for the rest."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def build_attention_mask(
    attention_mask: Optional[torch.Tensor], past: int, t: int, device: torch.device
) -> torch.Tensor:
    """Boolean mask for T queries at columns [past, past + T) over S = past + T keys.

    attention_mask: [B, S] (1 = real token, 0 = pad) or None (all real).
    Returns [B or 1, 1, T, S], True = may attend: causal, and the key is not padding.
    """
    s = past + t
    key_pos = torch.arange(s, device=device)
    query_pos = torch.arange(past, s, device=device)
    allowed = key_pos[None, :] <= query_pos[:, None]  # [T, S]
    if attention_mask is None:
        return allowed[None, None]
    allowed = allowed[None] & attention_mask.bool()[:, None, :]  # [B, T, S]
    # A pad query (e.g. a left-pad column) can have no visible real key; an all-False row
    # makes SDPA return NaN, which would poison sums over masked losses. Letting every query
    # see its own key keeps such rows finite and changes nothing for real tokens, whose own
    # key is always visible anyway.
    allowed = allowed | (key_pos[None, :] == query_pos[:, None])
    return allowed[:, None]


class CausalLM(nn.Module):
    def __init__(self, config: ArchConfig, seed: Optional[int] = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """Matrices ~ normal(0, 0.02), biases 0, norm weights 1. `seed` makes it reproducible
        without touching the global RNG."""
        device = self.embed_tokens.weight.device
        gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02, generator=gen)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
    ) -> KVCache:
        """Empty KVCache with per-layer K/V of shape [batch_size, num_kv_heads, max_len, head_dim]
        (dtype/device default to the model's)."""
        cfg = self.config
        return KVCache.allocate(
            cfg.num_layers,
            batch_size,
            cfg.num_kv_heads,
            max_len,
            cfg.head_dim,
            dtype or self.dtype,
            device or self.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] for input_ids [B, T].

        attention_mask: [B, S] with S = T without cache, cache.length + T with one
            (1 = real token, 0 = pad); pad keys are never attended to. None = all real.
        position_ids: [B, T]; defaults to cache.length + arange(T), which is only right
            without padding: left-padded batches must pass their own positions.
        cache: if given, the new tokens' K/V are appended at cache.length, they attend to
            all cached keys plus causally to each other, and cache.length advances by T.
        """
        b, t = input_ids.shape
        past = cache.length if cache is not None else 0
        if attention_mask is not None and attention_mask.shape != (b, past + t):
            raise ValueError(
                f"attention_mask must have shape {(b, past + t)} (batch, cached + new tokens), "
                f"got {tuple(attention_mask.shape)}"
            )
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        mask = build_attention_mask(attention_mask, past, t, input_ids.device)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, cache)
        if cache is not None:
            cache.advance(t)
        h = self.norm(h)
        if self.lm_head is None:
            return F.linear(h, self.embed_tokens.weight)
        return self.lm_head(h)
