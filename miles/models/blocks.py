"""Which attention and which feed-forward block each layer gets, from the ArchConfig feature blocks.

One place decides, so a family is a combination of blocks rather than a copy of the decoder.
Every attention block has `forward(x, ctx)` and `new_cache(batch, max_len, dtype, device)`;
every feed-forward block has `forward(x, ctx)`. The returned name is the layer's attribute name,
which is also its checkpoint name (`self_attn` / `linear_attn`, `mlp`).

`mtp=True` builds the block of a multi-token-prediction layer (miles.models.mtp), whose index lies
past the main layers: full attention (Qwen3-Next's MTP layer is gated attention whatever the linear /
full pattern would say there) and MoE wherever the model has experts (the checkpoints' MTP layers
are; SGLang and transformers build them so even when dense-first rules would not).
"""

from __future__ import annotations

from torch import nn

from miles.models.config import ArchConfig
from miles.models.layers import RMSNorm, SwiGLUMLP


def make_attention(cfg: ArchConfig, layer: int, mtp: bool = False) -> tuple[str, nn.Module]:
    if cfg.linear_attn is not None and cfg.linear_attn.is_linear_layer(layer) and not mtp:
        from miles.models.deltanet import GatedDeltaNet

        return "linear_attn", GatedDeltaNet(cfg, layer)
    if cfg.dsa is not None:  # DSA is MLA restricted to the keys its indexer selects
        from miles.models.dsa import SparseMLAttention

        return "self_attn", SparseMLAttention(cfg, layer)
    if cfg.mla is not None:
        from miles.models.mla import MLAttention

        return "self_attn", MLAttention(cfg, layer)
    if cfg.llama4 is not None:
        from miles.models.llama4 import Llama4Attention

        return "self_attn", Llama4Attention(cfg, layer)
    if cfg.linear_attn is not None:
        from miles.models.deltanet import GatedAttention

        return "self_attn", GatedAttention(cfg, layer)
    from miles.models.attention import Attention

    return "self_attn", Attention(cfg, layer)


def make_norm(cfg: ArchConfig, dim: int) -> nn.Module:
    """The decoder's pre-norms and final norm: Qwen3-Next's are zero-centered (x_hat * (1 + w),
    w stored around 0), every other family's plain RMSNorm (x_hat * w)."""
    if cfg.family == "qwen3_next":
        from miles.models.deltanet import ZeroCenteredRMSNorm

        return ZeroCenteredRMSNorm(dim, cfg.rms_norm_eps)
    return RMSNorm(dim, cfg.rms_norm_eps)


def make_mlp(cfg: ArchConfig, layer: int, mtp: bool = False) -> nn.Module:
    moe = cfg.moe is not None if mtp else cfg.is_moe_layer(layer)
    if cfg.llama4 is not None and moe:
        # Llama 4 scales the expert input by the router score and fuses experts as [E, H, 2I].
        from miles.models.llama4 import Llama4MoE

        return Llama4MoE(cfg, layer)
    if moe:
        from miles.models.moe import MoE

        return MoE(cfg, layer)
    return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
