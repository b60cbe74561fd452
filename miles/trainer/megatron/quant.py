"""The precision recipes on the Megatron-core trainer: INT4 QAT's fake-quantized training forward, and
the quantized weight-sync payloads (INT4, FP8) of every recipe that trains without FP8 GEMMs.

Which weights a recipe quantizes is decided on the native names (`Recipe.quantizes`: keep patterns,
kept layers, routers); GPTModel fuses q / k / v and gate / up along the output rows, so each Megatron
weight gets a row mask: the rows that come from quantized native weights. INT4 groups run along the
input dim of each row, so fake-quantizing a fused weight row by row is fake-quantizing each part.
QLoRA (trainer.lora under int4_qat): the base is frozen, so its round trip is taken once, on the
checkpoint's fp32 weights before they are cast to the training dtype (`int4_base`), and the forward
fake-quantizes nothing: the same values the per-forward round trip gives (fp32; in bf16 the values of
the torch trainer's QLoRA and the engine, which quantize the fp32 weights, not bf16 copies).
FP8 training (`train_quant=fp8`) multiplies FP8 operands in the forward, which Megatron-core does
through Transformer Engine only: refused (rules.py)."""

from __future__ import annotations

import torch

from miles.precision.fake_quant import fake_quant_int4
from miles.precision.recipe import INT4, Recipe
from miles.trainer.megatron.weights import to_megatron


def quantized_rows(native: dict[str, torch.Tensor], recipe: Recipe, arch, te: bool) -> dict[str, torch.Tensor]:
    """Megatron weight name -> [rows] bool, the rows the recipe quantizes (weights with none left out).
    Marks each native tensor (1.0: quantized) and maps the marks as the weights are mapped."""
    marks = {name: (torch.full((*t.shape[:-1], 1), float(recipe.quantizes(name, t))) if t.dim() >= 2
                    else torch.zeros(t.shape)) for name, t in native.items()}
    rows = {name: m[..., 0] > 0 for name, m in to_megatron(marks, arch, te).items() if m.dim() >= 2}
    return {name: r for name, r in rows.items() if r.any()}


def fake_quantized(model: torch.nn.Module, rows: dict[str, torch.Tensor], recipe: Recipe,
                   prefix: str = "") -> dict[str, torch.Tensor]:
    """INT4 QAT: {parameter name: its fake-quantized value} for `torch.func.functional_call`, rows
    not quantized kept as they are; gradients pass straight through to the parameters. `prefix`:
    where the GPTModel sits in `model` ("module." inside DistributedDataParallel)."""
    if recipe.train_quant != INT4:
        return {}
    params = dict(model.named_parameters())
    return {prefix + name: _round_trip(params[prefix + name], mask, recipe.group) for name, mask in rows.items()}


@torch.no_grad()
def int4_base(state: dict[str, torch.Tensor], rows: dict[str, torch.Tensor], recipe: Recipe) -> dict[str, torch.Tensor]:
    """QLoRA: `state` (Megatron names) with each quantized row replaced by its INT4 round trip, the
    other tensors as they are: the frozen base the engine holds, dequantized."""
    return {name: _round_trip(t, rows[name], recipe.group) if name in rows else t for name, t in state.items()}


def _round_trip(w: torch.Tensor, mask: torch.Tensor, group: int) -> torch.Tensor:
    """w's INT4 round trip on the rows `mask` marks (every row: the whole weight), in w's dtype."""
    fq = fake_quant_int4(w, group, w.dtype)
    return fq if bool(mask.all()) else torch.where(mask.to(w.device)[:, None], fq, w)
