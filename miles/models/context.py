"""What every layer of one forward call shares: positions, masks, the cache, routing records.

Built once per `CausalLM.forward`; RoPE tables and attention masks are computed on first use and
memoized, so layers with the same rotary width or the same mask kind share one tensor.

Three layouts reach the attention layers:
- padded rows (training, prefill, the CPU engine's decode): `attention_mask` [B, S], `past` an int;
- packed rows (training): `segment_ids` [B, T], several sequences per row, attention stays inside
  each one (0 marks padding);
- slot decode (the GPU engine): `past` a LongTensor [B], each row's own cache length; the row's
  new tokens are written from column past[row] on and attend to the columns up to their own (one
  token per row when decoding, k + 1 when speculative decoding verifies k drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from miles.models.cache import ModelCache


def causal_mask(attention_mask: Optional[torch.Tensor], past: int, t: int, device: torch.device,
                chunk: Optional[int] = None, segment_ids: Optional[torch.Tensor] = None,
                branch_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Boolean mask for T queries at columns [past, past + T) over S = past + T keys.

    attention_mask: [B, S] (1 = real token, 0 = pad) or None (all real). chunk: attend only within
    blocks of `chunk` token positions (Llama 4 chunked attention). Blocks follow each row's token
    positions (cumsum of its mask - 1), not columns: left padding must not move chunk boundaries,
    or a padded prefill + decode would differ from the unpadded forward (transformers likewise
    offsets chunks by the left padding). segment_ids: [B, T] packed rows (no cache): a query sees
    only keys of its own sequence. branch_ids: [B, T] with segment_ids, a shared prompt (0) followed by
    its responses (1, 2, ...): a response token sees the prompt and its own response only.
    Returns [B or 1, 1, T, S], True = may attend.
    """
    s = past + t
    key_pos = torch.arange(s, device=device)
    query_pos = torch.arange(past, s, device=device)
    allowed = key_pos[None, :] <= query_pos[:, None]  # [T, S]
    if chunk is not None:
        # token position of every column: [1, S] unpadded, else [B, S] (pads get their left neighbour's)
        token_pos = key_pos[None] if attention_mask is None else attention_mask.long().cumsum(-1) - 1
        block = torch.div(token_pos, chunk, rounding_mode="floor")
        allowed = allowed[None] & (block[:, None, :] == block[:, past:, None])  # [B or 1, T, S]
    else:
        allowed = allowed[None]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
        allowed = allowed & same & (segment_ids[:, None, :] > 0)
        if branch_ids is not None:
            key_branch = branch_ids[:, None, :]
            allowed = allowed & ((key_branch == 0) | (key_branch == branch_ids[:, :, None]))
    elif attention_mask is None:
        return allowed[:, None]
    else:
        allowed = allowed & attention_mask.bool()[:, None, :]  # [B, T, S]
    # A pad query (e.g. a left-pad column) can have no visible real key; an all-False row
    # makes SDPA return NaN, which would poison sums over masked losses. Letting every query
    # see its own key keeps such rows finite and changes nothing for real tokens, whose own
    # key is always visible anyway.
    allowed = allowed | (key_pos[None, :] == query_pos[:, None])
    return allowed[:, None]


def slot_mask(lengths: torch.Tensor, max_len: int, t: int = 1) -> torch.Tensor:
    """Slot decode: row b's new query j (of t, written at column lengths[b] + j) sees cache columns
    [0, lengths[b] + j] -> [B, 1, t, max_len]."""
    last = lengths[:, None] + torch.arange(t, device=lengths.device)[None, :]  # [B, t]
    return (torch.arange(max_len, device=lengths.device)[None, None, :] <= last[:, :, None])[:, None]


@dataclass
class ForwardContext:
    position_ids: torch.Tensor  # [B, T] absolute positions of the new tokens
    attention_mask: Optional[torch.Tensor]  # [B, S] 1 = real token, S = past + T; None = all real
    past: int | torch.Tensor  # positions already in the cache: an int, or per row [B] (slot decode)
    cache: Optional[ModelCache] = None
    # MoE layers write the experts they chose here (layer -> LongTensor [B, T, k]) when it is a
    # dict, and route by `routing_replay[layer]` instead of their router when that is given (R3).
    # DSA indexers do the same with the positions of the keys they keep, under ("keys", layer).
    routing_record: Optional[dict] = None
    routing_replay: Optional[dict] = None
    segment_ids: Optional[torch.Tensor] = None  # [B, T] packed sequences (0 = padding); no cache
    branch_ids: Optional[torch.Tensor] = None  # [B, T] with segment_ids: shared prompt 0, responses 1..n
    # [3, B, T] temporal / height / width positions of a vision-language family (mRoPE); RoPE
    # rotates by these instead of position_ids, which still order the tokens for the mask.
    mrope_position_ids: Optional[torch.Tensor] = None
    _memo: dict = field(default_factory=dict)

    @property
    def t(self) -> int:
        return self.position_ids.shape[1]

    @property
    def device(self) -> torch.device:
        return self.position_ids.device

    def memo(self, key, build: Callable[[], object]):
        """`build()` once per forward for each key (RoPE tables, masks)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    @property
    def slot_decode(self) -> bool:
        return isinstance(self.past, torch.Tensor)

    @property
    def plain_causal(self) -> bool:
        """No padding, no packing, nothing cached: SDPA's own is_causal (flash kernels) applies."""
        return self.attention_mask is None and self.segment_ids is None and not self.slot_decode and self.past == 0

    def mask(self, chunk: Optional[int] = None) -> torch.Tensor:
        if self.slot_decode:
            return self.memo(("slot_mask",), lambda: slot_mask(self.past, self.cache.max_len, self.t))
        return self.memo(("mask", chunk), lambda: causal_mask(self.attention_mask, self.past, self.t,
                                                              self.device, chunk, self.segment_ids,
                                                              self.branch_ids))

    def layer_cache(self, layer: int):
        return None if self.cache is None else self.cache.layers[layer]
