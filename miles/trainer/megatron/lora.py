"""LoRA on the Megatron-core trainer (`trainer=megatron`, `trainer.lora.rank > 0`; docs/megatron.md, "LoRA").

    lora = LoRA(skeleton, rank, alpha, ..., device=gpu)      # the native LoRA module (miles/models/lora.py)
    rows = adapter_rows(native_shapes, lora, arch)            # Megatron linear -> where its adapters' rows go
    attach(gpt, lora, rows)                                   # base frozen, adapters hooked, held by the GPTModel

The adapters are the native ones: `miles.models.lora.LoRA` built over a meta-device copy of the
native model (the same names, shapes, seeded initialisation, PEFT files and sync payload as
trainer=torch), its parameters on the GPU. Megatron fuses projections along their output rows
(q / k / v into `linear_qkv`, per query group; gate / up into `linear_fc1`; each expert of a stacked
`experts.gate_up_proj` into `local_experts.<e>.linear_fc1`), so each native adapter's output is
added to the rows of the fused output that come from its native weight. Which rows those are is
decided as the weights are mapped: every native row gets a number, the numbers go through
`weights.to_megatron` (as quant.py's INT4 row masks do), and each Megatron linear reads off which
native adapter and row each of its output rows is. A forward hook on the linear (the local spec's
Column / RowParallelLinear) then computes each native adapter's B A x on the linear's input,
concatenates them and places them by that row index (rows of weights not adapted get 0), scaled by
alpha / rank, exactly the native hook's sum: a zero B adds exactly 0, so a fresh adapter gives the
base model's log-probs bit for bit.

The adapters are registered as a submodule of the GPTModel (`miles_lora`) with the base frozen
(requires_grad=False), before DistributedDataParallel wraps it: megatron-core 0.19.2's DDP builds
gradient buffers only for parameters that require grad, and `get_megatron_optimizer` groups only
those, so Megatron's gradient buffers, distributed optimizer (no fp32 main copy for fp32 params),
clipping and grad norm see the adapters only; the base stays in the training dtype (bf16 or fp32)
with no gradient and no optimizer state.

Several adapters (trainer.lora.adapters): each row (padded) or token (packed, THD) goes through its
own adapter (masked as the native module masks, `_row_ids` laying the route out in Megatron's
sequence-major layout; an expert's permuted tokens found through its router's routing map,
`_expert_ids`); the trainer clips each adapter's gradient on its own and leaves an adapter without
samples out of the step (MegatronTrainer.step).

QLoRA: the base these hooks sit on is the recipe's round trip, taken once when the trainer is built
(quant.py), its linears holding the engine's INT4 / FP8 codes (held_base.py, after `attach`: the
hooks do not read the weight).

Not built: the Transformer Engine spec (its linears fuse the input norm, so the hook would see the
un-normalised input), refused here when TE is installed.
Every native projection LoRA can target (an nn.Linear under `layers.`, or a stacked expert tensor)
maps to one of Megatron's linears in the mapped families; `adapter_rows` refuses anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles.trainer.megatron.weights import to_megatron

LORA_MODULE = "miles_lora"  # the adapters' submodule in the GPTModel (so DDP and the optimizer see them)
# The local spec's linears an adapter can sit on (dense, MoE expert and shared-expert MLPs, GQA and MLA).
MEGATRON_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
                    "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")

@dataclass
class Rows:
    """Where one Megatron linear's adapters go: `pieces` (LoRA target index, expert or None), whose
    B A x are concatenated in this order, and `index` [out rows] into that concatenation (its last
    column is zeros where `zeros`); None: the concatenation is the output as it is."""
    pieces: list[tuple[int, int | None]]
    index: torch.Tensor | None
    zeros: bool


def adapter_rows(shapes: dict[str, torch.Size], lora, arch, te: bool = False) -> dict[str, Rows]:
    """Megatron module name -> Rows, for the LoRA targets of a native model whose tensors have
    `shapes`. Each native row of an adapted weight (each expert's row of a stack) is numbered, the
    numbers are mapped by `to_megatron` like the weights, and read back per Megatron weight."""
    keys = {lora.state_key(i): i for i in range(len(lora.names))}
    missing = sorted(set(keys) - set(shapes))
    if missing:
        raise KeyError(f"LoRA targets {missing[:4]} are not tensors of the native model")
    marks, blocks, start = {}, [], 1  # blocks: (target, expert, first number, rows); 0 = not adapted
    for name, shape in shapes.items():
        if len(shape) < 2:
            marks[name] = torch.zeros(shape, dtype=torch.float64)
            continue
        mark = torch.zeros(*shape[:-1], 1, dtype=torch.float64)
        if name in keys:
            stacked = len(shape) == 3
            for e in range(shape[0] if stacked else 1):
                rows = shape[-2]
                (mark[e] if stacked else mark)[:, 0] = torch.arange(start, start + rows, dtype=torch.float64)
                blocks.append((keys[name], e if stacked else None, start, rows))
                start += rows
        marks[name] = mark
    firsts = torch.tensor([b[2] for b in blocks], dtype=torch.long)
    out: dict[str, Rows] = {}
    for name, mark in to_megatron(marks, arch, te).items():
        if mark.dim() < 2 or not bool(mark.any()):
            continue
        if mark.dim() != 2 or not name.endswith(".weight"):
            raise ValueError(f"LoRA on trainer=megatron: {name} takes adapter rows but is no 2-D linear weight")
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] not in MEGATRON_LINEARS:
            raise ValueError(f"LoRA on trainer=megatron: an adapted native weight maps to {module}, which is not one "
                             f"of Megatron's linears ({', '.join(MEGATRON_LINEARS)})")
        codes = mark[:, 0].long()
        block = torch.searchsorted(firsts, codes, right=True) - 1  # -1 where the code is 0
        pieces, offsets, total = [], {}, 0
        for b in dict.fromkeys(block[codes > 0].tolist()):  # in order of first appearance
            target, expert, _, rows = blocks[b]
            if int((block == b).sum()) != rows:
                raise ValueError(f"LoRA on trainer=megatron: {module} holds part of a native weight's rows "
                                 "(tensor parallelism splits a projection): not built")
            pieces.append((target, expert))
            offsets[b] = total
            total += rows
        index = torch.full_like(codes, total)  # the zero column
        for b, offset in offsets.items():
            mine = block == b
            index[mine] = codes[mine] - firsts[b] + offset
        zeros = bool((codes == 0).any())
        identity = not zeros and torch.equal(index, torch.arange(total))
        out[module] = Rows(pieces, None if identity else index, zeros)
    return out


def _route(lora) -> torch.Tensor:
    """The route of this forward (what MegatronTrainer.forward set through lora.route), sequence-major:
    [1, rows] from padded rows' [rows, 1] (one adapter per row), [tokens, 1] from THD's [1, tokens]
    (packed: one sequence of tokens, an adapter per token)."""
    ids = lora._route
    if ids is None:
        raise RuntimeError(f"LoRA with {lora.num_adapters} adapters: no route set before the forward")
    return ids.T


def _row_ids(lora, x: torch.Tensor) -> torch.Tensor:
    """Several adapters: the route laid out against a Megatron linear's input, sequence-major:
    [s, rows, in] -> [1 or s, rows, 1]; flattened [s * rows, in] (token t of row r at t * rows + r)
    -> [s * rows, 1]."""
    ids = _route(lora)
    steps, rows = ids.shape
    if x.dim() == 3 and x.shape[1] == rows and steps in (1, x.shape[0]):
        return ids[..., None]
    if x.dim() == 2 and x.shape[0] % rows == 0 and steps in (1, x.shape[0] // rows):
        return ids.expand(x.shape[0] // rows, rows).reshape(-1, 1)
    raise ValueError(f"LoRA route of shape {tuple(lora._route.shape)} does not lay out over an input of shape "
                     f"{tuple(x.shape)}")


def _expert_ids(lora, routing_map: torch.Tensor, expert: int, x: torch.Tensor) -> torch.Tensor:
    """Several adapters on expert `expert`: the adapter of each token in its input [n, in]. The layer's
    tokens are flattened sequence-major (token t of row r at t * rows + r) and each expert's are the
    ones its column of the router's routing map [tokens, experts] marks, in ascending order (megatron-core
    0.19.2's permute with one expert-parallel rank: a stable argsort over the transposed map)."""
    route = _route(lora)
    rows = route.shape[1]
    flat = route.expand(routing_map.shape[0] // rows, rows).reshape(-1)
    ids = flat[routing_map[:, expert].nonzero().squeeze(1)][:, None]
    if ids.shape[0] != x.shape[0]:
        raise RuntimeError(f"LoRA route: expert {expert} got {x.shape[0]} tokens, its routing map marks {ids.shape[0]}")
    return ids


def _hook(lora, rows: Rows, routing: dict, layer: str | None):
    """The forward hook of one Megatron linear: its output plus alpha / rank * B A x of each native
    adapter placed on that adapter's rows (what the native hook adds to each native projection).
    Several adapters: each computed on every row, the other rows' results masked out (the native
    module's rule), so a row's gradient reaches its own adapter only; an expert's tokens by the
    routing map `routing[layer]` its MoE layer's router produced in this forward."""
    def add_delta(module, args, output):
        if not lora.enabled:
            return output
        out, bias = output  # Column / RowParallelLinear return (output, bias or None)
        x = args[0].to(lora.lora_A[0].dtype)  # as the native hook without autocast: fp32 adapters
        ids = None
        if lora.num_adapters > 1:
            expert = rows.pieces[0][1]  # an expert's linear holds that expert's rows only
            ids = _row_ids(lora, x) if expert is None else _expert_ids(lora, routing[layer], expert, x)
        parts = []
        for target, expert in rows.pieces:
            h = lora.dropout(x)
            part = None
            for k in range(lora.num_adapters):  # adapter k's pair of target i at k * len(names) + i
                j = k * len(lora.names) + target
                a, b = lora.lora_A[j], lora.lora_B[j]
                if expert is not None:
                    a, b = a[expert], b[expert]
                mine = F.linear(F.linear(h, a), b)
                if ids is not None:
                    mine = torch.where(ids == k, mine, 0.0)
                part = mine if part is None else part + mine
            parts.append(part)
        if rows.zeros:
            parts.append(x.new_zeros(*x.shape[:-1], 1))
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if rows.index is not None:
            delta = delta.index_select(-1, rows.index)
        return out + (delta * lora.scaling).to(out.dtype), bias
    return add_delta


def _require_grad(module, args, output):
    """The embedding's output requires grad in a training forward: Megatron's full recompute
    (trainer.recompute) checkpoints each layer with a reentrant autograd Function, which carries
    gradients only through its tensor inputs; with the embedding frozen the first layer's input needs
    none, so no adapter inside would get a gradient (transformers' `enable_input_require_grads`)."""
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_()
    return output


def _record_routing(routing: dict, layer: str):
    def record(module, args, output):
        routing[layer] = output[1]  # TopKRouter returns (probs, routing_map [tokens, experts])
    return record


def attach(gpt: torch.nn.Module, lora, rows: dict[str, Rows], recompute: bool = False) -> None:
    """Freeze `gpt` (in its dtype), register `lora` as its submodule (DDP and the optimizer then see
    the adapters only) and hook the adapters onto its linears. `recompute`: Megatron's full
    recompute is on (see _require_grad)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if any(getattr(m, "is_transposed", False) for m, _ in lora._experts):
        raise ValueError("trainer=megatron: LoRA on transposed expert stacks (Llama 4) is not mapped")
    gpt.requires_grad_(False)
    modules = dict(gpt.named_modules())
    routing: dict[str, torch.Tensor] = {}  # MoE layer -> its router's routing map in this forward
    if lora.num_adapters > 1 and lora._experts:
        from megatron.core.transformer.moe.router import TopKRouter

        for name, router in modules.items():
            if isinstance(router, TopKRouter):
                router.register_forward_hook(_record_routing(routing, name.rpartition(".")[0]))
    for name, place in rows.items():
        linear = modules.get(name)
        if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
            raise ValueError(f"LoRA on trainer=megatron: {name} is {type(linear).__name__}, not one of the local "
                             "spec's Column / RowParallelLinear (Transformer Engine's linears fuse the input norm)")
        if place.index is not None:  # on the linear's device once, not per forward
            place.index = place.index.to(linear.weight.device)
        layer = name.partition(".experts.local_experts.")[0] if ".experts.local_experts." in name else None
        linear.register_forward_hook(_hook(lora, place, routing, layer))
    if recompute:
        gpt.embedding.register_forward_hook(_require_grad)
    gpt.add_module(LORA_MODULE, lora)
    lora.requires_grad_(True)


def without_adapters(mstate: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GPTModel state dict without the adapters' entries (what weights.from_megatron maps)."""
    return {k: v for k, v in mstate.items() if not k.startswith(LORA_MODULE + ".")}
