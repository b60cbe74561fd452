"""Decoder-only causal language model of any supported family, built from an ArchConfig.

Layout (parameter names equal HF's minus the leading "model."; families rename the rest):
  embed_tokens -> layers[i] (pre-norm: x + attn(norm(x)), then h + ffn(norm(h))) -> norm -> lm_head.
Which attention and feed-forward block layer i gets is decided by `miles.models.blocks`.
With tie_word_embeddings there is no lm_head module: logits use embed_tokens.weight, so
the state dict holds the shared matrix once and tying survives any load or dtype cast.

The same `forward` serves training (no cache) and rollout decoding (with a ModelCache); the
mask built from the cache position is the only difference between the two, which is what
makes prefill + token-by-token decode reproduce the full-forward logits.

With `mtp_layers` > 0 the model also holds its multi-token-prediction modules (`mtp`,
miles.models.mtp), run by `mtp_forward` on the hidden states `forward(..., return_hidden=True)` gives.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.blocks import make_attention, make_mlp, make_norm
from miles.models.cache import ModelCache
from miles.models.config import ArchConfig
from miles.models.context import ForwardContext
from miles.models.layers import RMSNorm, embedding
from miles.models.mtp import MTPContext, MTPLayer


class DecoderLayer(nn.Module):
    """One pre-norm block; `mtp`: the block of an MTP depth (its attention / MLP kind, blocks.py)."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, mtp: bool = False):
        super().__init__()
        self.attn_name, attn = make_attention(cfg, layer_idx, mtp)
        setattr(self, self.attn_name, attn)  # registered under its checkpoint name
        self.mlp = make_mlp(cfg, layer_idx, mtp)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)

    @property
    def attn(self) -> nn.Module:
        return getattr(self, self.attn_name)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]."""
        h = x + self.attn(self.input_layernorm(x), ctx)
        return h + self.mlp(self.post_attention_layernorm(h), ctx)


class CausalLM(nn.Module):
    def __init__(self, config: ArchConfig, seed: Optional[int] = None):
        super().__init__()
        self.config = config
        # Under autocast: keep the residual stream (the embeddings and the sums of the layers' outputs)
        # in fp32 (True), or in the autocast dtype as the engine's weights keep it (False, the default;
        # precision.fp32_residual, set by the trainer).
        self.fp32_residual = False
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # Multi-token-prediction depths (miles.models.mtp), None when mtp_layers is 0; built last, so a
        # seed gives the main weights whether or not they are there.
        self.mtp = None
        if config.mtp_layers:
            self.mtp = nn.ModuleList(MTPLayer(config, DecoderLayer(config, config.num_layers + depth, mtp=True))
                                     for depth in range(config.mtp_layers))
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """Matrices ~ normal(0, 0.02), biases 0, norm weights 1; blocks with other needs (e.g.
        fused expert tensors, decay parameters) define `init_weights(gen)`. `seed` makes it
        reproducible without touching the global RNG."""
        device = self.embed_tokens.weight.device
        if device.type == "meta":  # no values to set (and meta normal_ imports torch._dynamo: see `embedding`)
            return
        gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        for module in self.modules():
            if module is not self and hasattr(module, "init_weights"):
                module.init_weights(gen)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
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
    ) -> ModelCache:
        """Empty decode state for `batch_size` rows and `max_len` positions (dtype / device default
        to the model's); each layer allocates its own kind (see cache.py)."""
        dtype, device = dtype or self.dtype, device or self.device
        layers = [layer.attn.new_cache(batch_size, max_len, dtype, device) for layer in self.layers]
        return ModelCache(layers, max_len, batch_size)

    def new_mtp_cache(
        self,
        batch_size: int,
        max_len: int,
        depth: int = 0,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
    ) -> ModelCache:
        """Empty decode state of MTP depth `depth` (its one attention layer), the `cache` of
        `mtp_forward(..., depth=depth)`; kept apart from the main model's, it advances on its own."""
        block = self._mtp_layer(depth).block
        dtype, device = dtype or self.dtype, device or self.device
        return ModelCache([block.attn.new_cache(batch_size, max_len, dtype, device)], max_len, batch_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        cache: Optional[ModelCache] = None,
        routing_record: Optional[dict] = None,
        routing_replay: Optional[dict] = None,
        segment_ids: Optional[torch.Tensor] = None,
        return_hidden: bool = False,
        branch_ids: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        mrope_position_ids: Optional[torch.Tensor] = None,
        layer_additions: Optional[list[torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] for input_ids [B, T] (with return_hidden, the final-norm hidden states
        [B, T, hidden] instead: the caller applies `output_weight` chunk by chunk).

        attention_mask: [B, S] with S = T without cache, cache.length + T with one
            (1 = real token, 0 = pad); pad keys are never attended to. None = all real.
        position_ids: [B, T]; defaults to cache.length + arange(T), which is only right
            without padding: left-padded batches must pass their own positions.
        cache: if given, the new tokens' state is appended at cache.length, they attend to
            all cached keys plus causally to each other, and cache.length advances by T.
            A SlotCache (per-row lengths) decodes one token per row at each row's own column.
        routing_record / routing_replay: MoE routing, layer -> experts [B, T, k] (see context.py).
        segment_ids: [B, T] packed rows, several sequences per row (0 = padding; no cache): each
            token attends only within its sequence; pass position_ids that restart per sequence.
        branch_ids: [B, T] with segment_ids, a sequence laid out as one prompt (0) then its responses
            (1, 2, ...), each response positioned after the prompt: the prompt is computed once.
        inputs_embeds: [B, T, hidden] used instead of embedding input_ids (a vision-language model
            has put its image features at the image tokens; miles.models.vlm).
        mrope_position_ids: [3, B, T] mRoPE positions (families with mrope_section; miles.models.vlm).
        layer_additions: [B, T, hidden] tensors added to the hidden states after layers 0, 1, ...
            (Qwen3-VL's DeepStack: inner vision-tower features at the image tokens; miles.models.vlm).
        """
        ctx = self._context(input_ids, attention_mask, position_ids, cache, routing_record, routing_replay,
                            segment_ids, branch_ids)
        ctx.mrope_position_ids = mrope_position_ids
        h = self.residual(self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds)
        additions = layer_additions or []
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx)
            if i < len(additions):  # in the stream's dtype: else fp32 features would promote every position
                h = h + additions[i].to(h.dtype)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        h = self.norm(h)
        return h if return_hidden else self.logits_from_hidden(h)

    def mtp_forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        depth: int = 0,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        cache: Optional[ModelCache] = None,
        return_hidden: bool = False,
        detach_embedding: bool = False,
    ) -> torch.Tensor:
        """MTP depth `depth` (miles.models.mtp): logits [B, T, V] at positions t predicting token t + 2,
        or with return_hidden its final-norm output [B, T, H] (what depth + 1 takes as `hidden`).

        hidden: [B, T, H] final-norm hidden states at positions t, from `forward(..., return_hidden=True)`
            (depth 0) or from this method with return_hidden (the depth before).
        input_ids: [B, T] the token at position t + 1 of each t.
        attention_mask / position_ids / cache: as in `forward`, positions being those of h_t (default
            cache.length + arange(T)); the cache is `new_mtp_cache(..., depth)`, it advances by T.
        detach_embedding: no gradient reaches the shared embedding through this call (online draft
            training updates the MTP modules only; the caller detaches the head's weight itself).
        """
        layer = self._mtp_layer(depth)
        if hidden.shape != (*input_ids.shape, self.config.hidden_size):
            raise ValueError(f"hidden must have shape {(*input_ids.shape, self.config.hidden_size)} "
                             f"(input_ids' batch and length, hidden_size), got {tuple(hidden.shape)}")
        ctx = self._context(input_ids, attention_mask, position_ids, cache, context=MTPContext)
        embeds = self.residual(self.embed_tokens(input_ids))
        h = layer(embeds.detach() if detach_embedding else embeds, hidden, ctx)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return h if return_hidden else self.logits_from_hidden(h)

    def _mtp_layer(self, depth: int) -> MTPLayer:
        if self.mtp is None:
            raise ValueError(f"this {self.config.family} model has no MTP modules: set mtp_layers > 0")
        if not 0 <= depth < len(self.mtp):
            raise ValueError(f"MTP depth {depth} out of range: the model has {len(self.mtp)} (mtp_layers)")
        return self.mtp[depth]

    def _context(self, input_ids, attention_mask, position_ids, cache, routing_record=None, routing_replay=None,
                 segment_ids=None, branch_ids=None, context=ForwardContext) -> ForwardContext:
        """The checks and defaults of `forward` (see there), shared with `mtp_forward`."""
        b, t = input_ids.shape
        past = cache.length if cache is not None else 0
        if isinstance(past, torch.Tensor):  # slot decode (SlotCache): the engine keeps rows in bounds
            if position_ids is None:
                position_ids = past[:, None]
        elif segment_ids is not None and (cache is not None or attention_mask is not None):
            raise ValueError("segment_ids (packed rows) take neither a cache nor an attention_mask")
        elif attention_mask is not None and attention_mask.shape != (b, past + t):
            raise ValueError(
                f"attention_mask must have shape {(b, past + t)} (batch, cached + new tokens), "
                f"got {tuple(attention_mask.shape)}"
            )
        elif cache is not None and past + t > cache.max_len:
            raise ValueError(f"KV cache overflow: {past + t} positions needed, max_len is {cache.max_len}")
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        return context(position_ids, attention_mask, past, cache, routing_record, routing_replay,
                       segment_ids=segment_ids, branch_ids=branch_ids)

    def residual(self, embeds: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: the embeddings in the autocast dtype under autocast (unless
        `fp32_residual`), so the layers add and normalize in it as with weights held in that dtype;
        as they are otherwise (weights in the compute dtype already, or fp32 compute)."""
        device = embeds.device.type
        if self.fp32_residual or not torch.is_autocast_enabled(device):
            return embeds
        return embeds.to(torch.get_autocast_dtype(device))

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [..., hidden] -> logits [..., V] (through lm_head's own module,
        which a precision recipe may have replaced)."""
        if self.lm_head is None:
            return F.linear(h, self.embed_tokens.weight)
        return self.lm_head(h)

    @property
    def output_weight(self) -> torch.Tensor:
        """The [V, hidden] matrix that turns final hidden states into logits (tied: the embedding)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def supports_packing(self) -> bool:
        """Whether segment_ids (packed rows) are honoured by every layer: the attention kinds that
        take the context's mask. Linear attention (recurrent state), DSA's indexer and Llama 4's
        chunks follow other rules and train on padded rows."""
        c = self.config
        return c.linear_attn is None and c.dsa is None and c.llama4 is None

    @property
    def supports_slot_decode(self) -> bool:
        """Whether the GPU engine's slot cache applies: every layer GQA attention (KVBuffer), MLA
        (MLACache, absorbed decode) or DSA (DSACache: MLA's plus the indexer keys, the top-k taken
        over each row's own columns), with any MLP, dense or MoE. Not linear attention (a recurrent
        state per row, not columns) nor Llama 4's chunked attention (chunks follow token positions,
        not slot columns)."""
        from miles.models.attention import Attention
        from miles.models.dsa import SparseMLAttention
        from miles.models.mla import MLAttention

        return all(type(layer.attn) in (Attention, MLAttention, SparseMLAttention) for layer in self.layers)
