"""Mixture-of-experts feed-forward block shared by every MoE family (Qwen3-MoE, Qwen3-Next,
DeepSeek-V3 / Kimi K2, GLM-4.5+, MiniMax-M2).

    out = routed_scaling_factor * sum_{e in topk} w_e * expert_e(x)   (+ shared experts)

Routing (`Router`, module name `gate` as in HF):
  scores   = softmax(logits) or sigmoid(logits)            (logits = x @ W^T, in float32)
  choice   = scores (+ e_score_correction_bias)            bias steers selection only (DeepSeek-V3)
  groups   = n_group groups of experts; keep the topk_group groups with the largest sum of their
             top-2 choice scores, mask the rest (DeepSeek-V3 group-limited routing)
  experts  = top-k of choice                               (or ctx.routing_replay[layer])
  weights  = scores at those experts (never the biased ones), / their sum if norm_topk_prob,
             * routed_scaling_factor
The chosen experts are written to ctx.routing_record[layer] ([B, T, k]) when recording, and
ctx.routing_replay[layer] replaces the router's choice when given (R3 routing replay: the trainer
reuses the rollout engine's experts; gradients still flow through the weights).

Experts are fused tensors (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]),
the in-memory layout of transformers 5; checkpoints store one tensor per expert and per matrix,
which `miles.models.families.moe_io` converts. Each expert runs only on the tokens routed to it.
Slot decode steps on CUDA take the grouped Triton kernels of `miles.models.moe_grouped` instead of
the expert loop (no host sync, so the slot decoder captures them in CUDA graphs), the FP8 / INT4
engines' quantized stacks too (miles/models/quant_experts.py). Elsewhere on CUDA (the trainer, prefill)
dense bf16 stacks run as two grouped GEMMs (`grouped_swiglu`, torch._grouped_mm) with their backward.
QLoRA's frozen holder, expert LoRA hooks and batch-invariant kernels keep the loop.

Shared experts (always on) are one SwiGLU of width shared_expert_intermediate_size; with
`shared_expert_gate` (Qwen2-MoE / Qwen3-Next) their output is scaled by sigmoid(x @ g) and the
module is named `shared_expert`, otherwise `shared_experts` (DeepSeek-V3 / GLM), as in HF.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from miles.models import invariant, moe_grouped
from miles.models.config import ArchConfig, MoEConfig
from miles.models.layers import SwiGLUMLP


def route(logits: torch.Tensor, moe: MoEConfig, bias: Optional[torch.Tensor] = None,
          replay: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure routing math. logits: [N, E] float32; bias: [E] or None; replay: [N, k] experts to use
    instead of the top-k. Returns (experts [N, k] long, weights [N, k] float32)."""
    n, e = logits.shape
    scores = logits.softmax(-1) if moe.scoring == "softmax" else logits.sigmoid()
    if replay is not None:
        experts = replay.reshape(n, -1).to(device=logits.device, dtype=torch.long)
    else:
        choice = scores if bias is None else scores + bias.float()
        if moe.n_group > 1:
            # A group's strength is the sum of its two best experts (DeepSeek-V3); experts outside
            # the topk_group strongest groups cannot be chosen.
            grouped = choice.view(n, moe.n_group, e // moe.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)
        experts = choice.topk(moe.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return experts, weights * moe.routed_scaling_factor


class Router(nn.Module):
    """`gate.weight` [E, H] (+ `gate.e_score_correction_bias` [E]). The bias is a Parameter so
    that checkpoint I/O treats it like any weight, but it is not trained by gradients (DeepSeek
    updates it with a load-balancing rule), hence requires_grad=False."""

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False) if moe.score_correction_bias else None
        )

    @torch.no_grad()
    def init_weights(self, gen: Optional[torch.Generator]) -> None:
        self.weight.normal_(0.0, 0.02, generator=gen)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor, replay: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (experts [N, k], weights [N, k] float32). Router math runs in float32
        (as HF DeepSeek-V3 / GLM), so that bf16 weights do not flip near-tied selections; autocast
        is switched off here, or it would run this matmul in bf16 again."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        return route(logits, self.moe, self.e_score_correction_bias, replay)


class Experts(nn.Module):
    """E SwiGLU experts as two fused tensors: gate_up_proj [E, 2I, H] (gate rows first, then up),
    down_proj [E, H, I]."""

    held_quantized = False  # QLoRA's frozen holder (miles/models/frozen_experts.py) says True
    is_transposed = False  # [E, out, in] (LoRA's name, PEFT's: Llama 4's x @ W stacks say True)

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        # LoRA on the stacked tensors (miles/models/lora.py): "gate_up_proj" / "down_proj" -> a
        # factory called once a forward, giving fn(expert, x, y, rows, total) that returns y plus that
        # expert's adapter output; rows: the indices of x's tokens among the `total` of the flat input
        # (routing several adapters). Once a forward, so the adapters' stacks are unbound once
        # (`stack_slices`). A plain dict, not state.
        self.lora_hooks: dict = {}

    @torch.no_grad()
    def init_weights(self, gen: Optional[torch.Generator]) -> None:
        self.gate_up_proj.normal_(0.0, 0.02, generator=gen)
        self.down_proj.normal_(0.0, 0.02, generator=gen)

    def expert_weight(self, name: str, e: int) -> torch.Tensor:
        """Expert e's [out, in] slice of the stacked tensor `name` (QLoRA's holder dequantizes it)."""
        return getattr(self, name)[e]

    def stacked_shape(self, name: str) -> torch.Size:
        """[E, out, in] of the stacked tensor `name`."""
        return getattr(self, name).shape

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [N, H], experts / weights: [N, k] -> [N, H] = sum_j weights[:, j] * expert_{experts[:, j]}(x).

        (token, slot) pairs are sorted by expert so each expert runs one matmul on a contiguous
        slice of its tokens (the layout a grouped GEMM takes); experts nobody chose cost nothing.
        Contributions are summed per token in ascending expert order, like HF's expert loop."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        tokens = order // k  # token of each sorted (token, slot) pair
        xs = pairs_by_expert(x, order, k)
        if grouped_gemm_applies(self, x):
            counts = expert_counts(flat, self.num_experts)
            y = grouped_swiglu(xs, counts, self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2))
            y = y * weights.reshape(-1)[order, None]
            return sum_in_expert_order(y, order, experts).to(x.dtype)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        gate_up_w, down_w = expert_slices(self, "gate_up_proj"), expert_slices(self, "down_proj")
        hooks = {name: bind() for name, bind in self.lora_hooks.items()}
        outs = []
        start = 0
        # One split, not a slice an expert: a slice's gradient is a zero-filled tensor of all of xs.
        for e, (c, h) in enumerate(zip(counts, xs.split(counts))):
            if c == 0:
                continue
            gate_up = F.linear(h, gate_up_w(e))
            rows = tokens[start:start + c] if hooks else None
            if "gate_up_proj" in hooks:
                gate_up = hooks["gate_up_proj"](e, h, gate_up, rows, x.shape[0])
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
            out = F.linear(act, down_w(e))
            if "down_proj" in hooks:
                out = hooks["down_proj"](e, act, out, rows, x.shape[0])
            outs.append(out)
            start += c
        if not outs:
            return torch.zeros_like(x)
        y = torch.cat(outs) * weights.reshape(-1)[order, None]  # float32 weights: product in float32
        if invariant.active() or y.is_cuda:
            # CUDA's index_add_ adds with atomics in any order: fp32 bits varied from run to run, and
            # a router near-tie turned one such bit into a 9e-3 log-prob gap between graph and eager
            # decode (diag on an H100). The same ascending-expert sum, in a fixed order.
            return sum_in_expert_order(y, order, experts).to(x.dtype)
        out = torch.zeros(x.shape, dtype=y.dtype, device=x.device)
        return out.index_add_(0, tokens, y).to(x.dtype)


# Devices where `Experts` and Llama 4's experts run as two grouped GEMMs (torch._grouped_mm) instead
# of the loop; tests add "cpu" to compare the two there.
GROUPED_GEMM_DEVICES = ("cuda",)
# Rows each expert's group is padded to: in backward the weight gradient contracts over a group's rows,
# and the CUDA kernel's TMA loads need each group to start 16-byte aligned (8 bf16 rows).
GROUP_ALIGN = 8


def grouped_gemm_applies(experts: nn.Module, x: torch.Tensor) -> bool:
    """Whether an experts module (`Experts`, Llama 4's) takes `grouped_swiglu`: dense stacks (not
    QLoRA's or the engines' quantized holders), no expert LoRA hooks, no batch-invariant mode (true
    on-policy keeps its fixed reduction order), bf16 compute on CUDA (the grouped kernel's dtype),
    widths that keep every operand's rows 16-byte aligned."""
    if x.device.type not in GROUPED_GEMM_DEVICES or experts.held_quantized or experts.lora_hooks \
            or invariant.active():
        return False
    dtype = grouped_dtype(x)
    if x.is_cuda and dtype != torch.bfloat16:
        return False
    _, rows, cols = experts.stacked_shape("gate_up_proj")
    hidden, two_i = (rows, cols) if experts.is_transposed else (cols, rows)
    return all(n * dtype.itemsize % 16 == 0 for n in (hidden, two_i // 2))


def grouped_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs compute in: autocast's where it is on (as F.linear's), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] pairs per expert, on the device without a host sync (CUDA's bincount reads the max first)."""
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def grouped_swiglu(xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU on its rows in two grouped GEMMs, with no host sync: xs [P, H] the
    expert-sorted pairs, counts [E] the pairs per expert (on the device), the stacks as x @ W takes
    them, gate_up [E, H, 2I] (gate columns first), down [E, I, H] -> [P, H]. The loop runs 6 small
    matmuls an expert (forward and backward) and syncs with the host for the counts; these are 6
    grouped GEMMs for all experts. Each group starts on a GROUP_ALIGN-row boundary (zero rows
    between groups: zero outputs, no gradient; rows past the last group are never read)."""
    dtype = grouped_dtype(xs)
    pairs, num_experts = xs.shape[0], counts.shape[0]
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = padded.cumsum(0)
    expert_of_pair = torch.repeat_interleave(torch.arange(num_experts, device=xs.device), counts, output_size=pairs)
    rank_in_expert = torch.arange(pairs, device=xs.device) - (counts.cumsum(0) - counts)[expert_of_pair]
    dest = (ends - padded)[expert_of_pair] + rank_in_expert
    rows = pairs + num_experts * (GROUP_ALIGN - 1)  # a bound on ends[-1] that needs no host sync
    spread = xs.new_zeros(rows, xs.shape[1], dtype=dtype).index_copy(0, dest, xs.to(dtype))
    offs = ends.to(torch.int32)
    h = torch._grouped_mm(spread, gate_up.to(dtype), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, down.to(dtype), offs=offs)
    return out.index_select(0, dest)


def pairs_by_expert(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """x [N, H] -> [N * k, H]: row i is x[order[i] // k], the token of the i-th expert-sorted (token,
    slot) pair. Gathered as k copies of each row, then permuted: in backward each row's k gradients
    are summed in a fixed order. `x[order // k]` sums them with index_put's accumulation, whose CPU
    threads add in any order (x's gradient bits varied from run to run on 2 cores). Without a gradient
    (the engine), the direct gather: the same rows, one copy fewer."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x[order // k]
    n, hidden = x.shape
    return x.unsqueeze(1).expand(n, k, hidden).reshape(n * k, hidden)[order]


def stack_slices(stack: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """e -> stack[e], for an expert loop. A stack that takes gradients (a trainer's parameter, its cast
    or fake-quantized copy, an adapter) is unbound once, so autograd stacks the experts' gradients
    into one tensor. Sliced per expert, each expert's gradient would be a zero-filled tensor of the
    whole stack, summed with the others': 128 of them a Qwen3-30B-A3B layer a micro-batch, most of its
    training step."""
    if torch.is_grad_enabled() and stack.requires_grad:
        return stack.unbind(0).__getitem__
    return stack.__getitem__


def expert_slices(experts: nn.Module, name: str) -> Callable[[int], torch.Tensor]:
    """e -> expert e's slice of the stacked tensor `name`: `stack_slices` where the stack can take
    gradients, else the holder's `expert_weight` (QLoRA's frozen and the engines' quantized holders
    dequantize the chosen slice there)."""
    stack = getattr(experts, name, None)
    if isinstance(stack, torch.Tensor) and stack.requires_grad:
        return stack_slices(stack)
    return functools.partial(experts.expert_weight, name)


def sum_in_expert_order(y: torch.Tensor, order: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Per token, 0 + its contributions in ascending expert order (what index_add_ does on the CPU).
    y: [N * k, H] in expert-sorted pair order, order: that sort, experts: [N, k] -> [N, H]."""
    n, k = experts.shape
    pairs = torch.empty_like(y)
    pairs[order] = y  # back to (token, slot) order
    by_expert = experts.argsort(dim=1, stable=True)  # each token's slots, ascending expert
    pairs = pairs.view(n, k, -1).gather(1, by_expert[..., None].expand(-1, -1, y.shape[-1]))
    out = torch.zeros_like(pairs[:, 0])
    for j in range(k):
        out = out + pairs[:, j]
    return out


class MoE(nn.Module):
    """Routed experts (+ shared experts) of one layer. forward: x [B, T, H] -> [B, T, H]."""

    def __init__(self, cfg: ArchConfig, layer: int):
        super().__init__()
        moe = cfg.moe
        self.layer = layer  # key of this layer in ctx.routing_record / routing_replay
        self.moe = moe
        self.gate = Router(cfg.hidden_size, moe)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.moe_intermediate_size)
        shared = moe.shared_expert_intermediate_size or moe.moe_intermediate_size * moe.num_shared_experts
        self.shared_name = None
        if moe.num_shared_experts > 0 or moe.shared_expert_intermediate_size > 0:
            # HF spells it `shared_expert` where it is gated (Qwen2-MoE / Qwen3-Next) and
            # `shared_experts` otherwise (DeepSeek-V3, GLM-4.5); using its spelling saves renames.
            self.shared_name = "shared_expert" if moe.shared_expert_gate else "shared_experts"
            setattr(self, self.shared_name, SwiGLUMLP(cfg.hidden_size, shared))
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if moe.shared_expert_gate else None

    def idle_params(self) -> int:
        """Routed-expert parameters a token does not use (E - k experts)."""
        per_expert = sum(math.prod(self.experts.stacked_shape(name)[1:]) for name in ("gate_up_proj", "down_proj"))
        return (self.moe.num_experts - self.moe.num_experts_per_tok) * per_expert

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        replay = None if ctx is None or ctx.routing_replay is None else ctx.routing_replay.get(self.layer)
        experts, weights = self.gate(flat, replay)
        if ctx is not None and ctx.routing_record is not None:
            ctx.routing_record[self.layer] = experts.view(b, t, -1)
        if moe_grouped.applies(self.experts, flat, ctx):  # slot decode on CUDA: no host sync, graph-capturable
            out = moe_grouped.grouped_experts(flat, experts, weights, *moe_grouped.grouped_stacks(self.experts))
        else:
            out = self.experts(flat, experts, weights)
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(b, t, h)


def graph_capturable(model: nn.Module) -> bool:
    """Whether the slot decoder may capture `model`'s (a CausalLM's) decode steps in CUDA graphs: every
    MoE layer is a `MoE` block whose experts take the grouped kernels in slot steps (what
    `moe_grouped.applies` will say on CUDA). Llama 4's experts, QLoRA's frozen holder and experts with
    LoRA hooks keep the expert loop, which reads each expert's token count on the host."""
    mlps = [layer.mlp for layer in model.layers]
    return moe_grouped.available() and all(type(mlp) is MoE and moe_grouped.grouped_stacks(mlp.experts) is not None
                                           for mlp in mlps if hasattr(mlp, "experts"))
