"""The project's DSA core attention for megatron-core's MLASelfAttention (DeepSeek-V3.2, GLM-5).

DeepSeek Sparse Attention is MLA whose queries attend only to the keys a lightning indexer selects
(miles/models/dsa.py). Here MLA itself is megatron-core's `MLASelfAttention` (its projections, latent
norms, YaRN RoPE), as for DeepSeek-V3; the core attention it builds is `DSACoreAttention`, which

- holds the indexer: the native `LightningIndexer` module itself (wq_b, wk, k_norm, weights_proj;
  frozen as in the native model: the LM loss cannot reach a top-k selection), so its scores, RoPE
  layouts, tie-breaking `topk_keep` and R3 replay / record are miles/models/dsa.py's code, not a copy;
- takes what the indexer reads from MLASelfAttention: megatron-core 0.19.2's MLA passes
  `x=hidden_states` (the layer's normalized input) and `qr=q_compressed` (the q latent after
  q_layernorm) to a core attention whose `requires_dsa_inputs` is true, so no MLA subclass is needed;
- attends with the project's SDPA (SDPACoreAttention) under the causal mask AND the kept keys, as
  the native `SparseMLAttention` does (a dense masked attention; the mask is what a gathering kernel
  would compute over).

Why not megatron-core's own DSA (transformer/experimental_attention_variant/dsa.py): its spec builder
asserts Transformer Engine (`_get_backend_spec_provider`), it replaces MLASelfAttention by its
`AbsorbedMLASelfAttention`, and its top-k is `torch.topk`, which breaks exact score ties arbitrarily;
the native model breaks them earliest-first (dsa.py's `topk_keep`), so the two would select other
keys at ties and the log-probs would not be the native trainer's.

Layers that share an earlier layer's selection (GLM's IndexShare, `dsa.shared_layers`) have no
indexer and read their source layer's latest selection from the `DSASelection` that every DSA core
attention of one GPTModel holds (specs.py makes one per model). Layers run in order, so the source
has run in the same forward; a recomputing backward (trainer.recompute) re-runs a layer after the
forward of the same micro-batch, with no other forward between (MegatronTrainer.step), so it reads
the same selection. R3: the trainer puts the forward's `routing_replay` / `routing_record` on the
DSASelection (the ("keys", layer) entries, [B, T, index_topk] in the micro-batch's row layout).

Layout: query [sq, b, heads, k], key [sk, b, heads, k], value [sk, b, heads, v], x [sq, b, hidden],
qr [sq, b, q_lora_rank]; output [sq, b, heads * v]. Rows are whole sequences from position 0 (the
trainer's padded rows): the causal mask type only; packed sequences are refused.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType

from miles.models.context import ForwardContext
from miles.models.dsa import LightningIndexer
from miles.trainer.megatron.core_attention import SDPACoreAttention


class DSASelection:
    """What the DSA core attentions of one GPTModel share: each indexer layer's latest selection
    (bool [B, 1, T, S], for the layers that reuse it), and the R3 replay / record of the forward in
    flight (set by the trainer; None otherwise)."""

    def __init__(self):
        self.keeps: dict[int, torch.Tensor] = {}
        self.replay: dict | None = None
        self.record: dict | None = None


def index_source(arch, layer: int) -> int:
    """The layer whose indexer selects `layer`'s keys: itself, or for a shared layer the nearest
    earlier layer with an indexer (as SparseMLAttention decides)."""
    shared = set(arch.dsa.shared_layers)
    if layer not in shared:
        return layer
    earlier = [i for i in range(layer) if i not in shared]
    if not earlier:
        raise ValueError(f"dsa.shared_layers: layer {layer} has no earlier indexer layer to share")
    return earlier[-1]


class DSACoreAttention(SDPACoreAttention):
    requires_dsa_inputs = True  # MLASelfAttention then passes x and qr (see the module docstring)

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str, *,
                 arch, selection: DSASelection, **kwargs):
        """megatron-core's core-attention arguments, plus `arch` (the project's ArchConfig: the
        indexer's sizes) and `selection` (shared by the model's DSA layers), given by the spec."""
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        self.layer_idx = layer_number - 1  # one pipeline stage: Megatron's 1-based global layer number
        self.index_source = index_source(arch, self.layer_idx)
        # A plain attribute that is not a Module: the model's layers share it, outside the state dict.
        self.selection = selection
        self.indexer = (LightningIndexer(arch, self.layer_idx).to(config.params_dtype)
                        if self.index_source == self.layer_idx else None)

    def _keep(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The kept keys, bool [B, 1, T, S]: this layer's indexer on [B, T, ...] inputs, or its source's."""
        if self.indexer is None:
            keep = self.selection.keeps.get(self.index_source)
            if keep is None or keep.shape[0] != x.shape[1] or keep.shape[-1] != x.shape[0]:  # x: [sq, b, h]
                raise RuntimeError(f"layer {self.layer_idx} shares the key selection of layer {self.index_source}, "
                                   "which has not run in this forward call")
            return keep
        dtype = self.indexer.wk.weight.dtype
        keep = self.indexer(x.transpose(0, 1).to(dtype), qr.transpose(0, 1).to(dtype), ctx)
        self.selection.keeps[self.layer_idx] = keep
        return keep

    def forward(self, query, key, value, attention_mask, attn_mask_type: AttnMaskType | None = None,
                attention_bias=None, packed_seq_params=None, *, x: torch.Tensor, qr: torch.Tensor):
        mask_type = attn_mask_type or self.attn_mask_type
        if packed_seq_params is not None or attention_bias is not None or mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"DSACoreAttention: unpacked rows under the causal mask only (got {mask_type}, "
                                      f"packed={packed_seq_params is not None}, bias={attention_bias is not None})")
        sq, b = query.shape[:2]
        if key.shape[0] != sq:
            raise NotImplementedError(f"DSACoreAttention: queries and keys of one sequence (got {sq}, {key.shape[0]})")
        positions = torch.arange(sq, device=query.device).expand(b, sq)
        ctx = ForwardContext(position_ids=positions, attention_mask=None, past=0,
                             routing_record=self.selection.record, routing_replay=self.selection.replay)
        mask = ctx.mask() & self._keep(x, qr, ctx)  # [B, 1, T, S]: causal and kept, True = attend
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = self._sdpa(q, k, v, mask, False)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
