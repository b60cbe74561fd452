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
QLoRA under fp8 w8a16: the same, with `fp8_round_trip` taken once on the fp32 checkpoint (the torch
trainer's FrozenQuantLinear / frozen experts quantize the fp32 weights; its forward dequantizes them).
FP8 w8a16 (`train_quant=fp8`, fp8_scheme w8a16, fp8's default): FP8 blocks are 128 x 128 in the
native layout, which GPTModel's fused q/k/v (interleaved per query group) and gate/up rows are not, so
each forward takes the weights the torch trainer multiplies: the Megatron state mapped to the native
tensors (weights.from_megatron), each quantized native tensor's FP8 round trip
(dequantize(quantize(w)), stacked MoE experts batched per expert as trainer=torch quantizes them), mapped
back (to_megatron). The mapping only moves elements, so the gradient passes straight through to each
parameter, as the torch trainer's. Made once per version of the weights (`FP8Blocks`, the recipe's
training cache: freed when a train step ends). FP8 w8a8 multiplies FP8 operands in the forward, which
Megatron-core does through Transformer Engine only: refused (rules.py)."""

from __future__ import annotations

import torch

from miles.precision.fake_quant import fake_quant_int4
from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight
from miles.precision.fp8_train import FP8WeightCache, _StraightThrough
from miles.precision.recipe import INT4, Recipe
from miles.trainer.megatron.weights import from_megatron, to_megatron


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


class FP8Blocks(FP8WeightCache):
    """FP8 w8a16 on Megatron: each quantized Megatron weight's value in the training forward, the FP8
    round trip of its native parts, computed once per version of a model's weights (the key: every
    watched parameter's storage and version counter). Megatron's optimizer writes the parameters through
    DDP's buffers, whose writes the counters need not see: the trainer releases the cache after each
    optimizer step, on load_state and before it offloads (and rl_update when a train step ends), through
    `Recipe.release_training_cache`, this being the recipe's `fp8_cache`."""

    def __init__(self):
        super().__init__()
        self._models: dict[int, tuple[tuple, dict[str, torch.Tensor]]] = {}

    def weights(self, model: torch.nn.Module, rows: dict[str, torch.Tensor], recipe: Recipe, arch, te: bool,
                prefix: str = "") -> dict[str, torch.Tensor]:
        """{parameter name: its FP8 value} for `torch.func.functional_call` (the names `rows` lists:
        the weights with a quantized native part), straight through to the parameters."""
        params = dict(model.named_parameters())
        watched = {name: params[prefix + name] for name in rows}
        key = tuple((p.data_ptr(), p._version, p.device, p.dtype) for p in watched.values())
        hit = self._models.get(id(model))
        if hit is None or hit[0] != key:
            inner = model.module if prefix else model
            hit = (key, fp8_round_trip(inner.state_dict(), list(watched), recipe, arch, te))
            self._models[id(model)] = hit
        return {prefix + name: _StraightThrough.apply(p, hit[1][name]) for name, p in watched.items()}

    def clear(self) -> None:
        super().clear()
        self._models.clear()

    def __len__(self) -> int:
        return super().__len__() + len(self._models)


@torch.no_grad()
def fp8_round_trip(state: dict[str, torch.Tensor], names: list[str], recipe: Recipe, arch,
                   te: bool) -> dict[str, torch.Tensor]:
    """The Megatron weights `names` of `state` (a GPTModel's whole state dict) as trainer=torch's w8a16
    forward multiplies them: native tensors the recipe quantizes -> dequantize(quantize(w)) in 128 x 128
    blocks (stacked experts per expert), in the weights' own dtype; the others as they are."""
    native = from_megatron(state, arch, te)
    native = {name: dequantize_fp8_weight(*quantize_fp8_weight(t), t.dtype) if recipe.quantizes(name, t) else t
              for name, t in native.items()}
    mega = to_megatron(native, arch, te)
    return {name: mega[name].contiguous() for name in names}
