"""Weight-absorbed MLA attention for slot decode (one new query per row over its cached latents).

The expanded form (miles/models/mla.py) turns every cached latent c [R] into per-head keys and values
through kv_b_proj, H * (nope + v) numbers per column at every step. Since kv_b_proj is linear, its two
halves fold into the query and the output instead (DeepSeek-V2's "absorbed" decode), per head h:

  q_nope . k_nope = q_nope . (W_UK[h] c) = (q_nope W_UK[h]) . c        a query in latent space [R]
  sum_s p_s v_s   = sum_s p_s (W_UV[h] c_s) = W_UV[h] (sum_s p_s c_s)   one up-projection per row

so a step reads each cached column once, as the MLA cache stores it: [c | k_rope] is the key of a
single shared head against the query [q_nope W_UK | q_rope], and c alone is its value. The weights
are views of the live kv_b_proj weight, so a weight update (in place or through load_state_dict)
reaches the next step with nothing cached to invalidate.

Numerics: the same products summed in another order (fp32: ~1e-6 from the expanded form); the
softmax runs in fp32 over the row's visible columns (the slot mask); scale is the module's own
(qk_head_dim^-0.5 times YaRN's mscale^2).
"""

from __future__ import annotations

import torch


def absorbed_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, kv_b_weight: torch.Tensor,
                       nope_dim: int, scale: float) -> torch.Tensor:
    """q [B, H, 1, nope + rope] (RoPE applied), kv [B, S, R + rope] the cache rows (normalized latent,
    then the rotated shared rope key), mask bool [B, 1, 1, S] (True = visible), kv_b_weight
    [H * (nope + v), R] -> attention output [B, H, 1, v], what softmax(q k^T * scale) v of the
    expanded keys and values gives."""
    b, h, _, qk_dim = q.shape
    rank = kv.shape[-1] - (qk_dim - nope_dim)
    w = kv_b_weight.to(q.dtype).view(h, -1, rank)  # per head [nope + v, R] (kv_b_proj's output order)
    w_uk, w_uv = w[:, :nope_dim], w[:, nope_dim:]  # [H, nope, R], [H, v, R]
    q_nope, q_rope = q[:, :, 0].split([nope_dim, qk_dim - nope_dim], dim=-1)  # [B, H, nope], [B, H, rope]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, R]
    query = torch.cat((q_latent, q_rope), dim=-1)  # [B, H, R + rope]: one product with each cache row
    scores = torch.bmm(query, kv.transpose(1, 2)).float() * scale  # [B, H, S]
    scores = scores.masked_fill(~mask[:, 0], float("-inf"))  # [B, 1, S] broadcast over the heads
    probs = torch.softmax(scores, dim=-1).to(kv.dtype)
    context = torch.bmm(probs, kv[..., :rank])  # [B, H, R]: the probability-weighted latent
    out = torch.bmm(context.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]
    return out[:, :, None]
