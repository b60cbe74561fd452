"""Multi-token prediction (MTP): DeepSeek-V3's sequential extra-token heads, as the DeepSeek-V3 / R1 /
V3.2, GLM-4.5+ / GLM-4.7-Flash / GLM-5 and Qwen3-Next checkpoints carry them (`CausalLM.mtp`).

Depth j at position t joins the hidden state of the previous depth (depth 0: the main model's
final-norm output h_t) with the embedding of the token one step further and predicts the token after:

  x = eh_proj([enorm(embed(token_{t+1+j})) ; hnorm(g_t^{j-1})])    [H, 2H] projection, embedding first
  g_t^j = norm(block(x))                                             one decoder layer of the family
  logits = lm_head(g_t^j)                                            the main model's head

g^j is what depth j + 1 takes. Embedding and LM head are the main model's (shared, as in the
DeepSeek-V3 report; checkpoints that store copies are checked equal on load, see
miles.models.families.mtp_io). Positions are those of h_t (vLLM's convention); RoPE sees only
differences, so transformers' t + 1 gives the same attention. vLLM also zeroes the embedding at
position 0 (carried over from its EAGLE path); SGLang and transformers do not, nor do we.

The block is built with layer index num_layers + j (blocks.py: always full attention, MoE where
the model has experts) and keeps its own decode state: a one-layer ModelCache
(`CausalLM.new_mtp_cache`), which `MTPContext` hands to the block whatever its layer index. It gets
no routing record or replay: R3 covers the policy's own layers only.

Parameter names: `mtp.<j>.{enorm, hnorm, eh_proj, block.<decoder layer>, norm}`; each family maps
them to its published layout.
"""

from __future__ import annotations

import torch
from torch import nn

from miles.models.blocks import make_norm
from miles.models.config import ArchConfig
from miles.models.context import ForwardContext


class MTPContext(ForwardContext):
    """The forward context of one MTP depth: its cache holds that depth's single attention layer."""

    def layer_cache(self, layer: int):
        return None if self.cache is None else self.cache.layers[0]


class MTPLayer(nn.Module):
    """One MTP depth around `block`, a DecoderLayer of the family (passed in: it lives in causal_lm)."""

    def __init__(self, cfg: ArchConfig, block: nn.Module):
        super().__init__()
        self.enorm = make_norm(cfg, cfg.hidden_size)
        self.hnorm = make_norm(cfg, cfg.hidden_size)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = block
        self.norm = make_norm(cfg, cfg.hidden_size)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """embeds (of the tokens one ahead), hidden (previous depth): [B, T, H] -> final-norm output [B, T, H]."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        return self.norm(self.block(x, ctx))
