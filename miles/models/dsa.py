"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): MLA that attends only to the keys a
lightning indexer selects.

The lightning indexer is a small, cheap attention of its own that scores every (query, key) pair:

  q_idx:  q latent (MLA's q_a_layernorm output) -> wq_b -> [B, T, H_idx, D_idx]
  k_idx:  x -> wk -> k_norm (LayerNorm, with bias) -> [B, S, D_idx], one key head shared by all
          indexer heads; the first qk_rope_head_dim dims of q_idx and k_idx get RoPE (same
          frequencies as MLA; rotate-half layout for V3.2, adjacent pairs for GLM-5)
  w:      x -> weights_proj -> [B, T, H_idx] * H_idx^-0.5   (per-query weight of each head)
  score[b, t, s] = sum_h w[b, t, h] * relu(q_idx[b, t, h] . k_idx[b, s] * D_idx^-0.5)

Each query then keeps its `index_topk` best-scoring visible keys (all of them while fewer are
visible), and MLA runs with that selection intersected with the causal / padding mask, exactly as
transformers' eager path folds the selection into the attention mask. On CPU a dense masked
attention is the clearest correct form; a kernel that gathers only the selected keys is the
optimization (the mask is the same).

The selection is not differentiable and the indexer gets no gradient from the language-model loss
(transformers runs it under no_grad; DeepSeek trains it with a separate distillation loss, which
RL post-training leaves alone), so `select_keys` runs under no_grad.

Ties: torch.topk breaks ties arbitrarily and differently for different row lengths, which would
let a padded prefill or a decode step pick other keys than the full forward when scores tie
exactly at the cut (e.g. keys whose indexer heads are all zeroed by the ReLU). `topk_keep` breaks
ties deterministically (earliest key first), so the same keys are selected on every path. This is
the one deliberate departure from transformers and DeepSeek's reference (both call torch.topk): a
score is exactly 0.0 for about 2^-index_n_heads of the (query, key) pairs, so with few indexer heads
ties at the cut are common and the logits past index_topk then differ from transformers' (whose own
cache decode differs from its own forward by as much there). Tie-free, or with transformers given
an earliest-first topk, the two agree to fp32 rounding (tests/unit/models/test_dsa_sparse_parity.py).

Decode: the indexer keys of past positions live in the layer cache (`DSACache`, next to MLA's
compressed latent; in the slot decoder each row writes its own columns and the top-k runs over the
row's visible columns, then attention takes MLA's absorbed form under the kept-keys mask). GLM's
cross-layer index sharing (`dsa.shared_layers`): such a layer has no indexer and reuses the
selection of the nearest earlier indexer layer from the same forward call.

R3 (`algo.routing_replay`): with a `routing_record` dict each indexer writes the positions of the keys
it kept (`("keys", layer)` -> [B, T, index_topk], -1 past the kept ones); with such an entry in
`routing_replay` it keeps exactly those keys instead of its own top-k (miles/types.py, selected keys).
"""

from __future__ import annotations

import torch
from torch import nn

from miles.models.config import ArchConfig
from miles.models.context import ForwardContext
from miles.models.mla import MLACache, MLAttention
from miles.models.rope import apply_rope, rope_cos_sin

INDEXER_NORM_EPS = 1e-6  # transformers' (and DeepSeek's) fixed k_norm eps, not config.rms_norm_eps


def topk_keep(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the k highest scores of each row. scores: [..., S] -> bool [..., S], True at
    exactly k entries per row (k <= S). Ties at the k-th value go to the earliest columns, so the
    choice depends only on the row's values and their order, not on the row's length."""
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > kth
    tie = scores == kth
    need = k - above.sum(-1, keepdim=True)
    return above | (tie & (tie.cumsum(-1) <= need))


class DSACache(MLACache):
    """MLA's compressed cache plus the indexer keys of every cached position:
    index_keys [B, max_len, index_head_dim] (None on layers that reuse another layer's selection)."""

    def __init__(self, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int, index_dim: int,
                 dtype, device):
        super().__init__(batch, max_len, kv_lora_rank, rope_dim, dtype, device)
        self.index_keys = (torch.zeros(batch, max_len, index_dim, dtype=dtype, device=device)
                           if index_dim else None)

    def update_index_keys(self, start: int | torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Write k [B, T, D] at [start, start + T); return all indexer keys so far [B, start + T, D]
        (a view into the buffer; the MLA `update` of the same call checks the length). Slot decode:
        start [B] per row, as MLACache.update, and the whole buffer comes back."""
        if isinstance(start, torch.Tensor):
            rows = torch.arange(k.shape[0], device=k.device)[:, None]
            cols = start[:, None] + torch.arange(k.shape[1], device=k.device)[None, :]
            self.index_keys[rows, cols] = k.to(self.index_keys.dtype)  # an index put does not cast
            return self.index_keys
        end = start + k.shape[1]
        self.index_keys[:, start:end] = k
        return self.index_keys[:, :end]

    def select(self, index: torch.Tensor) -> None:
        super().select(index)
        if self.index_keys is not None:
            self.index_keys = self.index_keys[index]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return super().tensors() + (() if self.index_keys is None else (self.index_keys,))

    def first_rows(self, b: int) -> "DSACache":
        view = super().first_rows(b)
        if self.index_keys is not None:
            view.index_keys = self.index_keys[:b]
        return view

    def copy_rows(self, dst: torch.Tensor, src: "DSACache", src_rows: torch.Tensor, width: int) -> None:
        super().copy_rows(dst, src, src_rows, width)
        if self.index_keys is not None:
            self.index_keys[dst, :width] = src.index_keys[src_rows, :width]


class LightningIndexer(nn.Module):
    """DSA's key selector. Parameter names match transformers' DeepseekV32Indexer / GlmMoeDsaIndexer
    (wq_b, wk, k_norm, weights_proj), so checkpoint names need no renames."""

    def __init__(self, cfg: ArchConfig, layer_idx: int):
        super().__init__()
        d, m = cfg.dsa, cfg.mla
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim, self.topk = d.index_n_heads, d.index_head_dim, d.index_topk
        self.rope_dim, self.rope_interleave = m.qk_rope_head_dim, d.rope_interleave
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.wq_b = nn.Linear(m.q_lora_rank, d.index_n_heads * d.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, d.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(d.index_head_dim, eps=INDEXER_NORM_EPS)
        # transformers keeps this projection in float32 even in bf16 checkpoints (it sets the
        # weight of every head's vote); forward computes it in the weight's own dtype.
        self.weights_proj = nn.Linear(cfg.hidden_size, d.index_n_heads, bias=False)
        # The LM loss cannot reach the indexer (its output is a discrete selection, computed under
        # no_grad): mark its weights frozen so that optimizers and trainable-parameter counts agree.
        self.requires_grad_(False)

    @torch.no_grad()
    def init_weights(self, gen) -> None:
        # The projections are nn.Linear (CausalLM.init_weights draws them); LayerNorm is not.
        self.k_norm.weight.fill_(1.0)
        self.k_norm.bias.zero_()

    def rope(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Rotate the first rope_dim dims of x: [B, H, T, D] at ctx's positions (the rest pass).
        Adjacent-pair layouts are de-interleaved first: q and k alike, so scores are unchanged
        (this is also exactly transformers' output layout)."""
        cos, sin = ctx.memo(("rope", self.rope_dim, self.rope_theta, id(self.rope_scaling)),
                            lambda: rope_cos_sin(ctx.position_ids, self.rope_dim, self.rope_theta,
                                                 self.rope_scaling))
        if self.rope_interleave:
            r = x[..., :self.rope_dim]
            x = torch.cat((r[..., 0::2], r[..., 1::2], x[..., self.rope_dim:]), dim=-1)
        return apply_rope(x, cos, sin)

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, ctx: ForwardContext,
               cache: DSACache | None = None) -> torch.Tensor:
        """Index scores, float32 [B, T, S] (S = ctx.past + T): x [B, T, hidden] (the attention
        input), q_latent [B, T, q_lora_rank]. Writes this call's indexer keys into `cache`."""
        b, t, _ = x.shape
        q = self.wq_b(q_latent).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(self.wk(x))[:, None]  # [B, 1, T, D]
        q = self.rope(q, ctx).transpose(1, 2)  # [B, T, H, D]
        k = self.rope(k, ctx)[:, 0]  # [B, T, D]
        if cache is not None:
            k = cache.update_index_keys(ctx.past, k).to(q.dtype)
        # relu(q.k) per head: [B, T, H, D] @ [B, 1, D, S] -> [B, T, H, S]
        dots = torch.matmul(q.float(), k.float().transpose(-1, -2)[:, None]) * self.head_dim ** -0.5
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        return torch.matmul(w[:, :, None], dots.relu())[:, :, 0]  # [B, T, 1, H] @ [B, T, H, S]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, ctx: ForwardContext,
                cache: DSACache | None = None) -> torch.Tensor:
        """The selected keys: bool [B, 1, T, S], True = kept; each query keeps its index_topk
        best visible keys (ctx.mask() decides visibility), or all of them when fewer are visible."""
        visible = ctx.mask()[:, 0]  # [B|1, T, S]
        replay = None if ctx.routing_replay is None else ctx.routing_replay.get(("keys", self.layer_idx))
        if replay is not None:  # R3: the keys the rollout engine's indexer kept
            keep = keys_from_positions(replay, visible, ctx)
            if cache is not None:  # the indexer keys still go into the cache for later steps
                self.scores(x, q_latent, ctx, cache)
        else:
            scores = self.scores(x, q_latent, ctx, cache).masked_fill(~visible, float("-inf"))
            # & visible: rows with fewer visible keys than topk fill up with masked (-inf) columns
            keep = topk_keep(scores, min(self.topk, scores.shape[-1])) & visible
        if ctx.routing_record is not None:
            ctx.routing_record[("keys", self.layer_idx)] = kept_positions(keep, ctx, self.topk)
        return keep[:, None]


def key_positions(ctx: ForwardContext, s: int) -> torch.Tensor:
    """Token position of each of the S key columns: [B, S] (left padding: a row's pads come first)
    or [1, S] without a mask."""
    if ctx.attention_mask is None:
        return torch.arange(s, device=ctx.device)[None]
    return ctx.attention_mask.long().cumsum(-1) - 1


def kept_positions(keep: torch.Tensor, ctx: ForwardContext, topk: int) -> torch.Tensor:
    """keep bool [B, T, S] -> the kept keys' positions [B, T, topk], ascending, -1 past the kept ones."""
    k = min(topk, keep.shape[-1])
    order = keep.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :k]  # kept columns first
    positions = key_positions(ctx, keep.shape[-1]).expand(keep.shape[0], -1)[:, None].expand_as(keep)
    out = positions.gather(-1, order).masked_fill(~keep.gather(-1, order), -1)
    return torch.nn.functional.pad(out, (0, topk - k), value=-1)


def keys_from_positions(positions: torch.Tensor, visible: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """Replayed key positions [B, T, topk] (-1 = none) -> keep bool [B, T, S]. Positions are columns
    here: replay runs on the trainer's rows, which start at column 0 and carry no mask."""
    if ctx.attention_mask is not None or ctx.past != 0:
        raise ValueError("replayed DSA keys apply to unpadded, uncached rows (the trainer's layout)")
    b, t, s = positions.shape[0], positions.shape[1], visible.shape[-1]
    cols = positions.to(device=visible.device, dtype=torch.long)
    cols = torch.where(cols < 0, s, cols)  # -1 -> an extra column, dropped below
    keep = torch.zeros(b, t, s + 1, dtype=torch.bool, device=visible.device).scatter_(-1, cols, True)
    keep = keep[..., :s] & visible
    # Positions without a record (padding, a sample's last token) keep what they see: a query with
    # no key would give NaN, and NaN activations poison weight gradients even where the loss is 0.
    unrecorded = (positions < 0).all(-1, keepdim=True).to(visible.device)
    return torch.where(unrecorded, visible, keep)


class SparseMLAttention(MLAttention):
    """MLA restricted to the indexer's keys. Same parameters as MLAttention plus `indexer`
    (absent on GLM layers that share an earlier layer's selection), HF names throughout."""

    def __init__(self, cfg: ArchConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        shared = set(cfg.dsa.shared_layers)
        if layer_idx in shared:
            earlier = [i for i in range(layer_idx) if i not in shared]
            if not earlier:
                raise ValueError(f"dsa.shared_layers: layer {layer_idx} has no earlier indexer layer to share")
            self.indexer, self.index_source = None, earlier[-1]
        else:
            self.indexer, self.index_source = LightningIndexer(cfg, layer_idx), layer_idx
        self.index_dim = cfg.dsa.index_head_dim

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> DSACache:
        index_dim = self.index_dim if self.indexer is not None else 0
        return DSACache(batch, max_len, self.kv_lora_rank, self.rope_dim, index_dim, dtype, device)

    def select_keys(self, x: torch.Tensor, q_latent: torch.Tensor, ctx: ForwardContext,
                    cache: DSACache | None) -> torch.Tensor:
        """bool [B, 1, T, S]: this layer's selection, or its source layer's (computed earlier in
        the same forward call, since layers run in order)."""
        key = ("dsa_keep", self.index_source)
        if self.indexer is None:
            return ctx.memo(key, self._no_source_selection)
        return ctx.memo(key, lambda: self.indexer(x, q_latent, ctx, cache))

    def _no_source_selection(self):
        raise RuntimeError(f"layer {self.layer_idx} shares the key selection of layer {self.index_source}, "
                           "which has not run in this forward call")

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]."""
        b, t, _ = x.shape
        q, q_latent = self.query(x, ctx)
        latent, k_rope = self.latent_kv(x, ctx)
        cache = ctx.layer_cache(self.layer_idx)
        if cache is not None:
            latent, k_rope = cache.update(ctx.past, latent, k_rope)
        keep = self.select_keys(x, q_latent, ctx, cache)
        out = self.attend_latent(q, latent, k_rope, cache, ctx, ctx.mask() & keep)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.v_dim))
