"""MoE experts for decode steps without host syncs: a Triton grouped GEMM over expert-sorted blocks.

    out = grouped_experts(x, experts, weights, gate_up_proj, down_proj)   # = Experts.forward's sum

`Experts.forward` sizes each expert's batch on the host (`counts.tolist()`) and launches one matmul
per chosen expert: a host sync and data-dependent shapes, so a step through it cannot be captured
in a CUDA graph. Here every shape and launch grid depends only on (N, k, E):

1. `block_layout` (plain torch, on the device): the N * k (token, slot) pairs sorted by expert, each
   expert's run padded to a multiple of BLOCK_M, and the expert of every BLOCK_M block. The number of
   blocks is the worst case, ceil((N k + min(E, N k) (BLOCK_M - 1)) / BLOCK_M); blocks past the real
   total have expert -1 and their programs exit at once.
2. `_gate_up_kernel`: per (block, I tile), the expert's gate and up rows times x's rows of the block's
   pairs (W x^T: the weight tile is the MMA's A operand), SiLU(gate) * up in the epilogue -> act
   [blocks * BLOCK_M, I] in x.dtype.
3. `_down_kernel`: per (block, H tile), the expert's down_proj times act, times the routing weight in
   fp32 -> y [N k, H] fp32, at each pair's own row (no two programs write one row).
4. `_combine_kernel`: per token, 0 + its k rows of y in ascending expert order (the order of
   Experts.forward's sum on the CPU), rounded to x.dtype once. Fixed order, no atomics: deterministic.

The weight operands are dense stacks or FP8 / INT4 ones (`Stack`), each weight dequantized as it is
loaded (`_load_w`, a constexpr branch per format).

Numerics match the eager loop's roundings: gate and up rounded to x.dtype (F.linear's output),
SiLU in fp32 rounded, times up rounded, the down product rounded before the fp32 routing weight. The
sums inside the GEMMs run in another order than cuBLAS's (fp32 accumulation both), so bf16 results
differ from eager by a bf16 rounding now and then; fp32 ones (IEEE dots, no TF32) by ~2e-7 relative
(tests/unit/models/test_moe_grouped.py, under the Triton interpreter).
Experts nobody chose cost nothing but their exiting programs; each active expert's weights are read
once per block of its tokens (one block at decode sizes: the active experts only).

Where it runs (`applies`): CUDA, a slot-decode step (the slot decoder's one token per row, or a
speculative verify's few), stacked bf16 / fp16 / fp32 experts of x's dtype, no autocast, no
batch-invariant kernels (true on-policy keeps the trainer's expert loop). The FP8 / INT4 engines hold
their stacks quantized (miles/models/quant_experts.py): the kernels read the codes and scales (`Stack`)
and dequantize each weight as they load it, to the bits the expert loop multiplies, so a decode step
reads 1 (FP8) or 1/2 (INT4) byte an expert weight instead of 2. QLoRA's frozen holder
(miles/models/frozen_experts.py) and experts with LoRA hooks (`lora_hooks`) keep the eager loop: those
hooks run per expert on its own tokens.
`miles.models.moe.graph_capturable` makes the same test once for a model, before the engine captures its
decode graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from miles.precision import invariance
from miles.precision.fp8 import BLOCK as FP8_BLOCK
from miles.precision.int4_triton import _interpreting

try:  # triton ships with CUDA torch wheels; the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

BLOCK_M = 16  # pairs per block: the smallest MMA height, as decode gives each expert a few tokens
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# On/off for the whole process (off: the expert loop, and no decode graphs for MoE models), to compare.
enabled = True
# Whether FP8 / INT4 stacks (the engines' quantized holders) take the kernels (on: an H100 ran them at
# 1.03-1.45x (FP8) and 1.12-1.41x (INT4) the bf16 stacks' speed, bit for bit the dequantized stacks';
# docs/benchmarks.md, twelfth session). Off: those engines decode their MoE layers through the expert loop,
# without CUDA graphs (to compare).
CODES_ON_CUDA = True


def available() -> bool:
    """The kernels can run in this process (Triton present, switched on, no batch-invariant kernels)."""
    return enabled and triton is not None and not invariance.active()


def grouped_stacks(experts: nn.Module) -> tuple[torch.Tensor | Stack, torch.Tensor | Stack] | None:
    """(gate_up_proj, down_proj) as the kernels take them: the dense stacks, or the engine's quantized
    holder's (miles/models/quant_experts.py); None where the expert loop must run (QLoRA's holder, LoRA
    hooks, Llama 4's transposed layout, other dtypes)."""
    if experts.lora_hooks or getattr(experts, "is_transposed", False):
        return None
    if getattr(experts, "holds_payload", False):
        return (experts.stack("gate_up_proj"), experts.stack("down_proj")) \
            if CODES_ON_CUDA and experts.dense_dtype in DTYPES else None
    dense = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if getattr(experts, "held_quantized", True) or not all(isinstance(t, torch.Tensor) for t in dense) \
            or dense[0].dtype not in DTYPES or dense[1].dtype != dense[0].dtype:
        return None
    return dense


def compute_dtype(experts: nn.Module) -> torch.dtype:
    """The dtype the experts multiply in: the dense stacks', or the one a quantized holder dequantizes to."""
    return experts.dense_dtype if getattr(experts, "holds_payload", False) else experts.gate_up_proj.dtype


def applies(experts: nn.Module, x: torch.Tensor, ctx) -> bool:
    """Whether this MoE call runs the grouped kernels (else `Experts.forward`'s loop)."""
    return (available() and x.is_cuda and getattr(ctx, "slot_decode", False) and grouped_stacks(experts) is not None
            and x.dtype == compute_dtype(experts) and not torch.is_autocast_enabled(x.device.type))


def max_blocks(pairs: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Blocks that cover `pairs` pairs over any split among the experts: each expert that holds
    pairs (at most min(E, pairs) of them) pads its run by at most block_m - 1."""
    return -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)


def block_layout(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-sorted blocks of (token, slot) pairs, computed on the device without host syncs.

    experts: [N, k] expert ids. Returns (pairs [blocks * block_m] int32: the pair index token * k +
    slot at each padded position, -1 on padding; block_expert [blocks] int32: the expert of each
    block, -1 past the last used block), blocks = max_blocks(N * k, E). Pairs of one expert are in
    (token, slot) order; experts in ascending order, each starting on a block boundary."""
    flat = experts.reshape(-1).long()
    device = flat.device
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    ids = torch.arange(num_experts, device=device)
    start = torch.searchsorted(sorted_experts, ids)  # first sorted pair of each expert
    count = torch.searchsorted(sorted_experts, ids, right=True) - start
    padded = (count + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    blocks = max_blocks(flat.numel(), num_experts, block_m)
    # Block j starts at j * block_m; its expert is the first whose padded run ends after that (E: none).
    block_expert = torch.searchsorted(padded_end, torch.arange(blocks, device=device) * block_m, right=True)
    used = block_expert < num_experts
    # Every padded position gathers its pair: its rank in its expert's run picks the sorted pair, up to
    # the expert's count. Gathers only (no scatter): deterministic kernels, no sort-based index_put.
    expert = block_expert.clamp(max=num_experts - 1)[:, None].expand(blocks, block_m).reshape(-1)
    rank = torch.arange(blocks * block_m, device=device) - (padded_end - padded)[expert]
    real = used[:, None].expand(blocks, block_m).reshape(-1) & (rank >= 0) & (rank < count[expert])
    source = (start[expert] + rank).clamp(0, flat.numel() - 1)
    pairs = torch.where(real, order[source], -1).to(torch.int32)
    block_expert = torch.where(used, block_expert, -1).to(torch.int32)
    return pairs, block_expert


if triton is not None:
    from miles.precision.int4_triton import _round

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        # fp32 operands: IEEE products (TF32 would round them). The interpreter multiplies bf16 dot
        # operands' raw bits, so there the same (exact) products also go through an fp32 IEEE dot.
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _load_w(w_base, s_base, offs_n, offs_k, n0, k0, n_ok, mask, stride_wn, stride_sn, QUANT: tl.constexpr,
                ROWS_PER_SCALE: tl.constexpr, COLS_PER_SCALE: tl.constexpr, TILE_SCALE: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr, INTERPRET: tl.constexpr):
        # The [BLOCK_N, BLOCK_K] tile W[n, k] (rows n0 + .., columns k0 + ..) of one expert in `dtype`.
        # Quantized stacks: code x scale in fp32, rounded once to dtype: the bits of dequantize_fp8_weight /
        # dequantize_int4 (what the eager loop multiplies), read as 1 (FP8) or 1/2 (INT4) byte a weight.
        # TILE_SCALE: the tile lies in one scale block along K (and along N for FP8), so its scales are one
        # value (FP8) or one per row (INT4), loaded once, not gathered per weight (4 bytes a weight).
        # One return, branches on constexprs only: the compiler builds the taken branch alone (code after
        # an early return is still compiled, and the INT4 bit operations refuse a bf16 pointer).
        if QUANT == 0:
            w = tl.load(w_base + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)
        else:
            if QUANT == 1:  # e4m3 codes [N, K]
                value = tl.load(w_base + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)
                value = value.to(tl.float32)
            else:  # two INT4 codes a byte, the even k in the low nibble; value = code - 8
                # Each byte loaded once (vector loads along the row), its nibbles interleaved by join +
                # reshape (int4_triton's unpack 0). Bytes past the row read 0x88, two zero codes. The row
                # ends at stride_wn bytes (a contiguous stack): a bound divisible by 16 where the row's
                # bytes are, which the asynchronous, pipelined copies need ((K + 1) // 2 proves nothing).
                offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                byte = tl.load(w_base + offs_n[:, None] * stride_wn + offs_b[None, :],
                               mask=n_ok[:, None] & (offs_b < stride_wn)[None, :], other=0x88)
                code = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_N, BLOCK_K))
                # code - 8 without an int-to-float conversion (quarter rate on Hopper; 128 a K tile in
                # this kernel before): 0x4B000000 | code is the fp32 2^23 + code, exactly.
                value = (code.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            if TILE_SCALE:
                if ROWS_PER_SCALE == 1:
                    scale = tl.load(s_base + offs_n * stride_sn + k0 // COLS_PER_SCALE, mask=n_ok, other=0.0)
                    w = _round(value * scale[:, None], dtype, INTERPRET)
                else:
                    w = _round(value * tl.load(s_base + (n0 // ROWS_PER_SCALE) * stride_sn + k0 // COLS_PER_SCALE),
                               dtype, INTERPRET)
            else:
                scale = tl.load(s_base + (offs_n // ROWS_PER_SCALE)[:, None] * stride_sn
                                + (offs_k // COLS_PER_SCALE)[None, :], mask=mask, other=0.0)
                w = _round(value * scale, dtype, INTERPRET)
        return w

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, act_ptr, H, I, stride_xm, stride_we,
                        stride_wn, stride_se, stride_sn, stride_am, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QUANT: tl.constexpr,
                        ROWS_PER_SCALE: tl.constexpr, COLS_PER_SCALE: tl.constexpr, TILE_SCALE: tl.constexpr,
                        IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        # Program (block, I tile): act rows of the block = SiLU(x W_gate^T) * (x W_up^T) on columns
        # [n0, n0 + BLOCK_N) of I, W = gate_up_proj[expert] (gate rows [0, I), up rows [I, 2I)).
        pid_m = tl.program_id(0)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + offs_m)
        row_ok = pair >= 0
        token = tl.where(row_ok, pair // TOPK, 0).to(tl.int64)
        n0 = tl.program_id(1) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        w_base = w_ptr + expert.to(tl.int64) * stride_we  # 64-bit: a DeepSeek-V3 stack passes 2^31 elements
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        dtype = act_ptr.dtype.element_ty
        # Accumulators [BLOCK_N, BLOCK_M] = W x^T: the weight tile is the MMA's A operand, which Hopper's
        # wgmma takes from registers (where the codes are dequantized) and which is 64 rows high where the
        # block's 16 tokens are too few for it (an H200: 1.00-1.11x x W^T on mma.sync at K tiles of 64).
        acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < H
            x = tl.load(x_ptr + token[:, None] * stride_xm + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_ok = n_ok[:, None] & k_ok[None, :]
            w_gate = _load_w(w_base, s_base, offs_n, offs_k, n0, k0, n_ok, w_ok, stride_wn, stride_sn, QUANT,
                             ROWS_PER_SCALE, COLS_PER_SCALE, TILE_SCALE, BLOCK_N, BLOCK_K, dtype, INTERPRET)
            w_up = _load_w(w_base, s_base, I + offs_n, offs_k, I + n0, k0, n_ok, w_ok, stride_wn, stride_sn,
                           QUANT, ROWS_PER_SCALE, COLS_PER_SCALE, TILE_SCALE, BLOCK_N, BLOCK_K, dtype, INTERPRET)
            acc_gate = _dot(w_gate, tl.trans(x), acc_gate, IEEE)
            acc_up = _dot(w_up, tl.trans(x), acc_up, IEEE)
        # The eager loop's roundings: gate_up in x.dtype, SiLU(gate) in x.dtype, the product in x.dtype.
        gate = _round(acc_gate, dtype, INTERPRET).to(tl.float32)
        up = _round(acc_up, dtype, INTERPRET).to(tl.float32)
        silu = _round(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRET).to(tl.float32)
        act = _round(silu * up, dtype, INTERPRET)
        tl.store(act_ptr + offs_m[None, :] * stride_am + offs_n[:, None], act, mask=row_ok[None, :] & n_ok[:, None])

    @triton.jit
    def _down_kernel(act_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, route_ptr, y_ptr, H, I, stride_am,
                     stride_we, stride_wn, stride_se, stride_sn, stride_ym, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QUANT: tl.constexpr,
                     ROWS_PER_SCALE: tl.constexpr, COLS_PER_SCALE: tl.constexpr, TILE_SCALE: tl.constexpr,
                     IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        # Program (block, H tile): y[pair] = routing weight * round(act W_down^T) on columns
        # [n0, n0 + BLOCK_N) of H, W = down_proj[expert] [H, I]; in fp32, at the pair's own row.
        pid_m = tl.program_id(0)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + offs_m)
        row_ok = pair >= 0
        n0 = tl.program_id(1) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # W a^T, as in the gate-up kernel
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < I
            a = tl.load(act_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = _load_w(w_base, s_base, offs_n, offs_k, n0, k0, n_ok, n_ok[:, None] & k_ok[None, :], stride_wn,
                        stride_sn, QUANT, ROWS_PER_SCALE, COLS_PER_SCALE, TILE_SCALE, BLOCK_N, BLOCK_K,
                        act_ptr.dtype.element_ty, INTERPRET)
            acc = _dot(w, tl.trans(a), acc, IEEE)
        route = tl.load(route_ptr + pair, mask=row_ok, other=0.0)
        out = _round(acc, act_ptr.dtype.element_ty, INTERPRET).to(tl.float32) * route[None, :]
        rows = tl.where(row_ok, pair, 0).to(tl.int64)
        tl.store(y_ptr + rows[None, :] * stride_ym + offs_n[:, None], out, mask=row_ok[None, :] & n_ok[:, None])

    @triton.jit
    def _combine_kernel(y_ptr, slots_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                        INTERPRET: tl.constexpr):
        # Program (token, H tile): 0 + the token's k rows of y, its slots taken in ascending expert
        # order (slots_ptr: that order per token), rounded to out's dtype once.
        token = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(TOPK):
            slot = tl.load(slots_ptr + token * TOPK + j)
            acc += tl.load(y_ptr + (token * TOPK + slot) * H + offs, mask=ok, other=0.0)
        tl.store(out_ptr + token * H + offs, _round(acc, out_ptr.dtype.element_ty, INTERPRET), mask=ok)


class Stack(NamedTuple):
    """A stacked expert tensor as the kernels read it: dense [E, N, K] in x's dtype (no scale), FP8
    e4m3 codes [E, N, K] with fp32 128x128 block scales [E, ceil(N/128), ceil(K/128)], or INT4 bytes
    [E, N, ceil(K/2)] (two codes a byte, rollout_format's) with fp32 group scales [E, N, ceil(K/group)]."""
    w: torch.Tensor
    scale: torch.Tensor | None = None
    fmt: str = "dense"  # dense, fp8, int4
    group: int = 128


_QUANT = {"dense": 0, "fp8": 1, "int4": 2}


def _operand(stack: torch.Tensor | Stack) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(weights, scales, the kernel's constexprs) of a stacked tensor, dense or quantized."""
    stack = stack if isinstance(stack, Stack) else Stack(stack)
    w = stack.w.contiguous()  # parameters and held buffers: no copy
    if stack.fmt == "dense":
        return w, w, dict(QUANT=0, ROWS_PER_SCALE=1, COLS_PER_SCALE=1)
    w = w.view(torch.uint8) if stack.fmt == "int4" else w
    per = (1, stack.group) if stack.fmt == "int4" else (FP8_BLOCK, FP8_BLOCK)
    return w, stack.scale.contiguous(), dict(QUANT=_QUANT[stack.fmt], ROWS_PER_SCALE=per[0], COLS_PER_SCALE=per[1])


def grouped_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor | Stack,
                    down_proj: torch.Tensor | Stack, block_n: int = 64, block_k: int | None = None) -> torch.Tensor:
    """sum_j weights[:, j] * expert_{experts[:, j]}(x), SwiGLU experts, as `Experts.forward` computes it.

    x: [N, H]; experts: [N, k] ids; weights: [N, k] (float32); gate_up_proj: [E, 2I, H]; down_proj:
    [E, H, I], both x.dtype or quantized (`Stack`: each weight dequantized to x.dtype as it is loaded,
    the eager loop's bits) -> [N, H] in x.dtype. No host syncs; launch grids from (N, k, E) only.
    block_k: K tiles of 128 (fp32: 64, its IEEE dots hold fp32 tiles in shared memory: at 128, with FP8's
    per-weight scales, more than Hopper's 227 KB); on an H100 they ran 1.04-1.26x (FP8) and
    1.01-1.04x (INT4) as fast as 64 at 1-256 rows (docs/benchmarks.md, twelfth session)."""
    n, hidden = x.shape
    k = experts.shape[1]
    block_k = block_k or (64 if x.dtype == torch.float32 else 128)
    gate_up, gate_up_scale, gate_up_quant = _operand(gate_up_proj)
    down, down_scale, down_quant = _operand(down_proj)
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    x = x if x.stride(-1) == 1 else x.contiguous()
    pairs, block_expert = block_layout(experts, num_experts)
    blocks = block_expert.shape[0]
    ieee = x.dtype == torch.float32 or _interpreting()
    common = dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, INTERPRET=_interpreting())
    act = torch.empty(blocks * BLOCK_M, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n * k, hidden, dtype=torch.float32, device=x.device)
    route = weights.reshape(-1).float().contiguous()
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, gate_up, gate_up_scale, pairs, block_expert, act, hidden, inter, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), *_scale_strides(gate_up_scale, gate_up_quant), act.stride(0), TOPK=k,
        TILE_SCALE=_tile_scale(gate_up_quant, block_n, block_k, inter), **gate_up_quant, **common)
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, down, down_scale, pairs, block_expert, route, y, hidden, inter, act.stride(0), down.stride(0),
        down.stride(1), *_scale_strides(down_scale, down_quant), y.stride(0),
        TILE_SCALE=_tile_scale(down_quant, block_n, block_k, 0), **down_quant, **common)
    slots = experts.argsort(dim=1, stable=True).contiguous()  # each token's slots, ascending expert
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    block = 256
    _combine_kernel[(n, triton.cdiv(hidden, block))](y, slots, out, hidden, TOPK=k, BLOCK=block,
                                                     INTERPRET=_interpreting())
    return out


def _tile_scale(quant: dict, block_n: int, block_k: int, row_offset: int) -> bool:
    """Whether every [block_n, block_k] weight tile lies in one scale block along K, and along N where a
    scale covers several rows (FP8; `row_offset`: the up half's first row, I, in gate_up), so the kernel
    loads its scales once a tile instead of one a weight."""
    rows, cols = quant["ROWS_PER_SCALE"], quant["COLS_PER_SCALE"]
    return cols % block_k == 0 and (rows == 1 or (rows % block_n == 0 and row_offset % block_n == 0))


def _scale_strides(scale: torch.Tensor, quant: dict) -> tuple[int, int]:
    """(expert, row) strides of a stack's scales; 0 for a dense stack (its scale argument is unread)."""
    return (scale.stride(0), scale.stride(1)) if quant["QUANT"] else (0, 0)
