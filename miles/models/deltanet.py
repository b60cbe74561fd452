"""Qwen3-Next's two token mixers: gated DeltaNet (linear attention) and gated full attention.

GatedDeltaNet (most layers) keeps a fixed-size recurrent state per head, S: [Dk, Dv], updated by the
gated delta rule for each token t (q, k L2-normalized, q scaled by Dk^-0.5):
    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - exp(g_t) * S_{t-1}^T k_t))^T,   o_t = S_t^T q_t
with beta_t = sigmoid(b_t) (write strength) and g_t = -exp(A_log) * softplus(a_t + dt_bias) <= 0
(log decay). q / k / v first go through a causal depthwise conv (kernel 4) and silu; the output is
RMS-normalized per head, gated by silu(z) and projected back. Training runs the chunked form of
the recurrence (exact, a triangular solve per chunk); decoding runs the same code on one token,
starting from the cached state, so both paths share their arithmetic.

GatedAttention (every `full_attention_interval`-th layer) is GQA with QK-norm and partial rotary
whose q_proj also yields a per-channel output gate: out = o_proj(attn * sigmoid(gate)).

Qwen3-Next's RMSNorms (decoder norms, final norm, q/k norms) are zero-centered: y = x_hat * (1 + w),
stored w initialized to 0 (`ZeroCenteredRMSNorm`); the DeltaNet output norm is a plain-weight
gated RMSNorm. Parameter names and layouts match transformers' Qwen3Next modules exactly.

Left padding: pad positions (attention_mask 0) are zeroed before the projections (so the conv sees
zeros, as at the sequence start) and are no-ops of the recurrence (g = 0, beta = 0), so a
left-padded prefill + decode equals the unpadded forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.models import invariant
from miles.models.cache import KVBuffer
from miles.models.config import ArchConfig
from miles.models.context import ForwardContext
from miles.models.rope import apply_rope, rope_cos_sin

CHUNK = 64  # tokens per chunk of the chunked delta rule (one triangular solve of this size each)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 if it already is (a float64 model stays float64 end to end)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class ZeroCenteredRMSNorm(nn.Module):
    """y = x / rms(x) * (1 + weight), computed in float32 and cast back at the end (Qwen3-Next's
    rounding order). weight starts at 0, so a fresh norm is the identity scale. x: [..., dim]."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    @torch.no_grad()
    def init_weights(self, gen=None) -> None:
        self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _wide(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + _wide(self.weight))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """y = weight * x / rms(x) * silu(gate), over the last dim (DeltaNet output norm, plain weight
    starting at 1). x, gate: [..., dim]."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    @torch.no_grad()
    def init_weights(self, gen=None) -> None:
        self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = _wide(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.to(x.dtype) * h.to(x.dtype)  # x's dtype, as RMSNorm (miles/models/fused.py)
        return (h * F.silu(_wide(gate))).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (eps inside the root, as the FLA kernels)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor | None = None, chunk: int = CHUNK, states: list | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a sequence, chunk by chunk, in float32.

    q, k: [B, H, T, Dk] (already L2-normalized, q scaled); v: [B, H, T, Dv]; g (log decay, <= 0) and
    beta: [B, H, T]; state: [B, H, Dk, Dv] or None (zeros). Returns (out [B, H, T, Dv], final state).
    `states`: a list that receives the state at the end of every chunk (with chunk=1, every token).

    Within a chunk with cumulative log decay G_t (G_t - G_s = log of the decay from s to t), the
    deltas d_t = beta_t (v_t - S_{t-1}^T k_t exp(g_t)) that the tokens write satisfy the unit lower
    triangular system
        d_t + beta_t sum_{s<t} exp(G_t - G_s) (k_t . k_s) d_s = beta_t v_t - beta_t exp(G_t) S0^T k_t,
    so one triangular solve replaces the token loop; then
        o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) d_s,
        S_end = exp(G_end) S0 + sum_s exp(G_end - G_s) k_s d_s^T.
    """
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (_wide(x) for x in (q, k, v, g, beta))
    state = torch.zeros(b, h, dk, dv, dtype=q.dtype, device=q.device) if state is None else state.to(q.dtype)
    outs = []
    for start in range(0, t, chunk):
        sl = slice(start, min(start + chunk, t))
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        n = qc.shape[2]
        cum = g[:, :, sl].cumsum(-1)  # [B, H, n]
        # exp(G_t - G_s) for s <= t; the upper triangle would overflow exp, so it is -inf first.
        upper = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [B, H, n, n]
        k_beta = kc * bc[..., None]
        system = (k_beta @ kc.transpose(-1, -2)) * decay  # strictly-lower part is the coupling; diag ignored
        rhs = torch.cat((vc * bc[..., None], k_beta * cum.exp()[..., None]), dim=-1)
        sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, w = sol[..., :dv], sol[..., dv:]  # delta = u - w @ S0
        delta = u - w @ state  # [B, H, n, Dv]
        scores = (qc @ kc.transpose(-1, -2)) * decay  # [B, H, n, n], causal within the chunk
        outs.append((qc * cum.exp()[..., None]) @ state + scores @ delta)
        tail = (cum[..., -1:] - cum).exp()[..., None]  # decay from each token to the chunk end
        state = state * cum[..., -1].exp()[..., None, None] + (kc * tail).transpose(-1, -2) @ delta
        if states is not None:
            states.append(state)
    return torch.cat(outs, dim=2), state


class DeltaNetCache:
    """Decode state of one GatedDeltaNet layer: the last K-1 conv inputs [B, conv_dim, K-1] and the
    recurrent state [B, Hv, Dk, Dv] (at least float32 whatever the model dtype: it accumulates every token).

    Speculative decoding sets `track_steps` around a verify forward: the layer then keeps the state
    after each of its tokens and the whole conv input, and `rewind(keep)` goes back to the state
    after each row's first keep[b] tokens (the accepted ones)."""

    def __init__(self, batch: int, conv_dim: int, kernel: int, heads: int, dk: int, dv: int, dtype, device):
        self.conv_state = torch.zeros(batch, conv_dim, kernel - 1, dtype=dtype, device=device)
        self.state = torch.zeros(batch, heads, dk, dv, dtype=torch.promote_types(dtype, torch.float32), device=device)
        self.track_steps = False
        self.steps: tuple[torch.Tensor, torch.Tensor] | None = None  # (states [B, T, ...], conv input [B, C, K-1+T])

    def select(self, index: torch.Tensor) -> None:
        self.conv_state, self.state = self.conv_state[index], self.state[index]

    def rewind(self, keep: torch.Tensor) -> None:
        states, conv_input = self.steps
        rows = torch.arange(len(keep), device=keep.device)
        self.state = states[rows, keep - 1]
        width = self.conv_state.shape[-1]
        window = keep[:, None] + torch.arange(width, device=keep.device)  # the K-1 inputs before the next token
        self.conv_state = conv_input.gather(-1, window[:, None, :].expand(-1, conv_input.shape[1], -1))
        self.steps = None


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (transformers' Qwen3NextGatedDeltaNet). x: [B, T, hidden] -> same."""

    def __init__(self, cfg: ArchConfig, layer_idx: int):
        super().__init__()
        la = cfg.linear_attn
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = la.num_key_heads, la.num_value_heads
        self.head_k_dim, self.head_v_dim = la.key_head_dim, la.value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = la.conv_kernel_size
        # Checkpoint layout: per key head, [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] and [b (r), a (r)],
        # r = Hv / Hk value heads per key head.
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.num_v_heads, bias=False)
        # Depthwise causal conv over the concatenated [q | k | v] channels; only its weight
        # [conv_dim, 1, K] is used (F.conv1d), the module keeps the checkpoint name conv1d.weight.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    @torch.no_grad()
    def init_weights(self, gen=None) -> None:
        """Conv ~ N(0, 0.02) like the projections; dt_bias = 1; A ~ U(0.01, 16) (decay rates spread
        over orders of magnitude, kept away from 0 so A_log is finite), as transformers does."""
        self.conv1d.weight.normal_(0.0, 0.02, generator=gen)
        self.dt_bias.fill_(1.0)
        self.A_log.copy_(torch.empty(self.num_v_heads, device=self.A_log.device).uniform_(0.01, 16, generator=gen).log())

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> DeltaNetCache:
        return DeltaNetCache(batch, self.conv_dim, self.kernel, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                             dtype, device)

    def _conv(self, x: torch.Tensor, cache: DeltaNetCache | None) -> torch.Tensor:
        """Causal depthwise conv + silu. x: [B, conv_dim, T] -> same; with a cache, the previous K-1
        inputs come from it (zeros at the start) and it keeps the last K-1 afterwards."""
        t = x.shape[-1]
        weight = self.conv1d.weight
        if cache is None:
            out = F.conv1d(x.to(weight.dtype), weight, padding=self.kernel - 1, groups=self.conv_dim)[..., :t]
        else:
            full = torch.cat((cache.conv_state.to(x.dtype), x), dim=-1)
            cache.conv_state = full[..., -(self.kernel - 1):].to(cache.conv_state.dtype)
            if cache.track_steps:  # rewind picks each row's K-1 inputs before its next token from it
                cache.steps = (None, full.to(cache.conv_state.dtype))
            out = F.conv1d(full.to(weight.dtype), weight, groups=self.conv_dim)
        return F.silu(out).to(x.dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]."""
        b, t, _ = x.shape
        real = None if ctx.attention_mask is None else ctx.attention_mask[:, -t:].to(x.dtype)  # [B, T]
        if real is not None:
            x = x * real[..., None]  # pad inputs are zero: the conv window sees them as sequence start
        r = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(b, t, self.num_k_heads, 2 * self.head_k_dim + 2 * r * self.head_v_dim)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, r * self.head_v_dim, r * self.head_v_dim], -1)
        beta_logit, a = self.in_proj_ba(x).view(b, t, self.num_k_heads, 2 * r).split([r, r], -1)
        mixed = torch.cat((q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)), dim=-1)
        cache = ctx.layer_cache(self.layer_idx)
        mixed = self._conv(mixed.transpose(1, 2), cache).transpose(1, 2)  # [B, T, conv_dim]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], -1)
        # [B, H, T, D]; each key head serves r consecutive value heads.
        q = q.reshape(b, t, self.num_k_heads, self.head_k_dim).repeat_interleave(r, dim=2).transpose(1, 2)
        k = k.reshape(b, t, self.num_k_heads, self.head_k_dim).repeat_interleave(r, dim=2).transpose(1, 2)
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim).transpose(1, 2)
        q = l2norm(_wide(q)) * self.head_k_dim ** -0.5
        k = l2norm(_wide(k))
        beta = _wide(beta_logit.reshape(b, t, self.num_v_heads)).sigmoid()
        # float32 before exp: A_log in bf16 / fp16 could overflow to -inf decay.
        g = -_wide(self.A_log).exp() * F.softplus(_wide(a.reshape(b, t, self.num_v_heads)) + _wide(self.dt_bias))
        if real is not None:  # pad steps leave the state untouched (no decay, no write)
            g, beta = g * _wide(real)[..., None], beta * _wide(real)[..., None]
        # Batch-invariant kernels (true on-policy): one token per chunk, the recurrence a decode
        # step runs, so a full forward and prefill + decode do the same arithmetic.
        # Tracked (speculative verify): one token per chunk too, and the state after each kept.
        tracked = cache is not None and cache.track_steps
        states = [] if tracked else None
        out, state = gated_delta_rule(q, k, v, g.transpose(1, 2), beta.transpose(1, 2),
                                      None if cache is None else cache.state,
                                      chunk=1 if invariant.active() or tracked else CHUNK, states=states)
        if cache is not None:
            cache.state = state
        if tracked:
            cache.steps = (torch.stack(states, 1), cache.steps[1])
        out = self.norm(out.transpose(1, 2).to(x.dtype), z.reshape(b, t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.reshape(b, t, self.value_dim))


class GatedAttention(nn.Module):
    """Qwen3-Next full attention (transformers' Qwen3NextAttention): GQA, zero-centered QK-norm,
    partial rotary, and a sigmoid output gate from q_proj. x: [B, T, hidden] -> same."""

    def __init__(self, cfg: ArchConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rotary_dim, self.rope_theta, self.rope_scaling = cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # Per head, q_proj yields [query (D), gate (D)].
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> KVBuffer:
        return KVBuffer(batch, self.num_kv_heads, max_len, self.head_dim, self.head_dim, dtype, device)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]."""
        b, t, _ = x.shape
        q, gate = self.q_proj(x).view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = ctx.memo(("rope", self.rotary_dim, self.rope_theta, id(self.rope_scaling)),
                            lambda: rope_cos_sin(ctx.position_ids, self.rotary_dim, self.rope_theta,
                                                 self.rope_scaling))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache = ctx.layer_cache(self.layer_idx)
        if cache is not None:
            k, v = cache.update(ctx.past, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask(),
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out * torch.sigmoid(gate.reshape(b, t, -1)))
