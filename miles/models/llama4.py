"""Llama 4 (Scout, Maverick) blocks: iRoPE attention and the Llama 4 mixture of experts.

Attention (`Llama4Attention`, GQA, parameter names as HF: q_proj, k_proj, v_proj, o_proj):
  RoPE layers  RoPE in Meta's interleaved layout (dims 2j and 2j+1 form a pair with frequency j,
               HF applies it as a complex product), then an L2 norm without weight on q and k
               (use_qk_norm), then causal attention within chunks of attention_chunk_size
               token positions (position // chunk equal for query and key).
  NoPE layers  every nope_layer_interval-th layer: no RoPE, no qk-norm, global causal attention;
               with attn_temperature_tuning the queries are scaled by
               1 + attn_scale * log1p(floor((pos + 1) / floor_scale)) so that attention stays sharp
               at long context (arXiv 2501.19399).
  Positions are the tokens' own (ctx.position_ids, and the mask's chunks follow them), so a
  left-padded prefill + decode equals the unpadded forward. transformers counts the temperature
  positions from the cache column instead; the two agree without padding.

MoE (`Llama4MoE`, HF `Llama4TextMoe`):
  router    logits = x @ W^T; experts = top-k of logits (k = 1 in Scout / Maverick)
  weight    sigmoid(chosen logit); it scales the expert's INPUT: expert_e(w * x), not w * expert_e(x)
  output    shared_expert(x) + sum over chosen experts
Experts are fused as in HF's checkpoints: `experts.gate_up_proj` [E, H, 2I] (gate columns first)
and `experts.down_proj` [E, I, H] (x @ W layout, the transpose of miles.models.moe's). Routing is
recorded to / replayed from ctx like every MoE block (layer -> experts [B, T, k]).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.cache import KVBuffer
from miles.models.config import ArchConfig
from miles.models.context import ForwardContext
from miles.models.layers import SwiGLUMLP
from miles.models.moe import (expert_counts, expert_slices, grouped_gemm_applies, grouped_swiglu, pairs_by_expert,
                              sum_in_expert_order)
from miles.models.rope import rope_cos_sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2j], x[2j+1]) by angle j. x: [B, T, H, D]; cos / sin: [B, T, D] from
    rope_cos_sin (rotate-half layout: both halves hold the D/2 angles). Computed in float32 as HF
    (complex product), returned in x's dtype."""
    half = cos.shape[-1] // 2
    c, s = cos[:, :, None, :half], sin[:, :, None, :half]  # [B, T, 1, D/2]
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1)  # [B, T, H, D/2, 2]
    return out.flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32, no weight (HF Llama4TextL2Norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int):
        super().__init__()
        l4 = cfg.llama4
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.use_rope = l4.uses_rope(layer_idx)
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        # Chunked attention only on RoPE layers; NoPE layers see the whole context.
        self.chunk = l4.attention_chunk_size if self.use_rope else None
        self.qk_norm_eps = cfg.rms_norm_eps if (l4.use_qk_norm and self.use_rope) else None
        self.temperature = (l4.floor_scale, l4.attn_scale) if (l4.attn_temperature_tuning and not self.use_rope) else None
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.attention_bias)  # HF: o_proj has the bias too

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> KVBuffer:
        return KVBuffer(batch, self.num_kv_heads, max_len, self.head_dim, self.head_dim, dtype, device)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            cos, sin = ctx.memo(("rope", self.head_dim, self.rope_theta, id(self.rope_scaling)),
                                lambda: rope_cos_sin(ctx.position_ids, self.head_dim, self.rope_theta,
                                                     self.rope_scaling))
            q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
        if self.qk_norm_eps is not None:  # after RoPE, as Llama 4 (Qwen3 normalizes before)
            q, k = l2_norm(q, self.qk_norm_eps), l2_norm(k, self.qk_norm_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            pos = ctx.position_ids.float()  # [B, T]
            scale = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scale[:, :, None, None]).to(q.dtype)  # float32 product, as HF
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        cache = ctx.layer_cache(self.layer_idx)
        if cache is not None:
            k, v = cache.update(ctx.past, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=ctx.mask(chunk=self.chunk), enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class Llama4Experts(nn.Module):
    """E SwiGLU experts, HF Llama 4 layout: gate_up_proj [E, H, 2I], down_proj [E, I, H]."""

    # LoRA (miles/models/lora.py) on these stacks: the x @ W layout, [E, in, out], which PEFT calls
    # transposed; its adapters are then applied as x @ B_e @ A_e (A [E, rank, out], B [E, in, rank]).
    is_transposed = True
    held_quantized = False  # QLoRA's frozen holder (miles/models/frozen_experts.py) says True

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        # As miles.models.moe.Experts.lora_hooks: "gate_up_proj" / "down_proj" -> a factory called once
        # a forward, giving fn(expert, x, y, rows, total) that returns y plus that expert's adapter
        # output. A plain dict, not state.
        self.lora_hooks: dict = {}

    def stacked_shape(self, name: str) -> torch.Size:
        """The stacked tensor `name`'s shape as held, [E, in, out]."""
        return getattr(self, name).shape

    def expert_weight(self, name: str, e: int) -> torch.Tensor:
        """Expert e's [in, out] slice of the stacked tensor `name` (QLoRA's holder dequantizes it)."""
        return getattr(self, name)[e]

    @torch.no_grad()
    def init_weights(self, gen: Optional[torch.Generator]) -> None:
        self.gate_up_proj.normal_(0.0, 0.02, generator=gen)
        self.down_proj.normal_(0.0, 0.02, generator=gen)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [N, H]; experts: [N, k] long; weights: [N, k] (scale each expert's input).
        Returns [N, H] = sum_j expert_{experts[:, j]}(weights[:, j] * x). Each expert runs only on
        the tokens routed to it (HF runs every expert on every token with zero-scaled inputs, which
        gives the same sum because a bias-free SwiGLU maps 0 to 0)."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        tokens = order // k  # token of each sorted (token, slot) pair
        xs = pairs_by_expert(x, order, k) * weights.reshape(-1)[order, None].to(x.dtype)
        if grouped_gemm_applies(self, x):
            counts = expert_counts(flat, self.num_experts)
            y = grouped_swiglu(xs, counts, self.gate_up_proj, self.down_proj)
            return sum_in_expert_order(y, order, experts)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        gate_up_w, down_w = expert_slices(self, "gate_up_proj"), expert_slices(self, "down_proj")
        hooks = {name: bind() for name, bind in self.lora_hooks.items()}
        outs, start = [], 0
        for e, (c, h) in enumerate(zip(counts, xs.split(counts))):  # one split: moe.Experts.forward
            if c == 0:
                continue
            gate_up = h @ gate_up_w(e)
            rows = tokens[start:start + c] if hooks else None
            if "gate_up_proj" in hooks:  # on the scaled input, as W_e + B_e A_e would see it
                gate_up = hooks["gate_up_proj"](e, h, gate_up, rows, x.shape[0])
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
            out = act @ down_w(e)
            if "down_proj" in hooks:
                out = hooks["down_proj"](e, act, out, rows, x.shape[0])
            outs.append(out)
            start += c
        if not outs:
            return torch.zeros_like(x)
        y = torch.cat(outs)  # compute dtype: x's, or autocast's when weights are float32
        if y.is_cuda and k > 1:  # index_add_'s CUDA atomics sum in any order: moe.Experts.forward's fixed order
            return sum_in_expert_order(y, order, experts)
        return torch.zeros(x.shape, dtype=y.dtype, device=x.device).index_add_(0, tokens, y)


class Llama4MoE(nn.Module):
    """Routed experts (input-scaled by the sigmoid of the chosen logit) + one always-on shared
    expert. forward: x [B, T, H] -> [B, T, H]. Parameter names as HF: router.weight [E, H],
    experts.gate_up_proj / experts.down_proj, shared_expert.{gate,up,down}_proj."""

    def __init__(self, cfg: ArchConfig, layer: int):
        super().__init__()
        moe = cfg.moe
        self.layer = layer  # key of this layer in ctx.routing_record / routing_replay
        self.num_experts, self.top_k = moe.num_experts, moe.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = Llama4Experts(moe.num_experts, cfg.hidden_size, moe.moe_intermediate_size)
        shared = moe.shared_expert_intermediate_size or moe.moe_intermediate_size * moe.num_shared_experts
        self.shared_expert = SwiGLUMLP(cfg.hidden_size, shared)

    def idle_params(self) -> int:
        """Routed-expert parameters a token does not use (E - k experts)."""
        per_expert = sum(math.prod(self.experts.stacked_shape(name)[1:]) for name in ("gate_up_proj", "down_proj"))
        return (self.num_experts - self.top_k) * per_expert

    def forward(self, x: torch.Tensor, ctx: Optional[ForwardContext] = None) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        # float32 router (HF uses the weights' dtype): bf16 logits would flip near-tied choices.
        logits = F.linear(flat.float(), self.router.weight.float())  # [N, E]
        replay = None if ctx is None or ctx.routing_replay is None else ctx.routing_replay.get(self.layer)
        if replay is not None:
            experts = replay.reshape(b * t, -1).to(device=x.device, dtype=torch.long)
        else:
            experts = logits.topk(self.top_k, dim=-1).indices
        if ctx is not None and ctx.routing_record is not None:
            ctx.routing_record[self.layer] = experts.view(b, t, -1)
        weights = logits.gather(1, experts).sigmoid()  # [N, k]; gradients reach the router here
        out = self.shared_expert(flat) + self.experts(flat, experts, weights)
        return out.view(b, t, h)
