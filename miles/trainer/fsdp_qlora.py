"""QLoRA on the FSDP2 trainer (trainer=fsdp, trainer.lora.rank > 0, precision=fp8 / int4_qat): the frozen
base held quantized, as the 1-process trainer holds it (miles/precision/qlora.py,
miles/models/frozen_experts.py), and sharded over the ranks.

    recipe = prepare(trainer)           # before fully_shard: the codes become frozen parameters
    shard(model, mesh, NO_CAST)         # miles/trainer/fsdp.py: FSDP2 shards and gathers them
    state = gathered_state(model, writes)   # the dense (dequantized) base on rank 0, a unit at a time

Why the codes are sharded parameters, not buffers: `fully_shard` shards parameters and replicates
buffers, and a replicated quantized base costs each rank the whole base (1 byte a weight in FP8,
~0.53 in INT4) where the sharded bf16 base of plain LoRA costs 2 / ranks bytes: from 2 ranks on,
QLoRA would hold more per rank than LoRA. As frozen parameters (requires_grad=False) the codes and
their scales are sharded like any weight, all-gathered in their own dtypes around their unit's
forward and backward (FSDP2 gathers mixed dtypes as bytes, and never casts a non-float tensor) and
never reduced (no gradient). The gathered codes are what `FrozenQuantLinear` / the expert holders
(`FrozenStacks`: either layout, Llama 4's transposed one included) read by name, so their forward,
and its backward (which rebuilds the dense weight from the codes inside the unit's backward, where
FSDP has gathered them again), run as in one process.

No mixed-precision casting (`NO_CAST`): an FP8 code is a float to FSDP2, which would round it to
bf16 on the gather; and the recipe's kept tensors (embeddings, head, norms) are fp32 masters that
the 1-process trainer reads under bf16 autocast: gathered as they are, the ranks compute what it
computes.

Recipe.forward has nothing left to fake-quantize once every weight it quantizes is held quantized
(checked here), and must not take the codes, parameters now, for master weights: the ranks run
with the recipe's training quantization off (`train_quant=none`), its rollout format unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from miles.models.frozen_experts import FrozenStacks
from miles.precision.qlora import FrozenQuantLinear
from miles.precision.recipe import NONE, Recipe

NO_CAST = MixedPrecisionPolicy()
HOLDERS = (FrozenQuantLinear, FrozenStacks)  # FrozenStacks: either expert layout


def holds_quantized_base(model: nn.Module) -> bool:
    return any(isinstance(m, HOLDERS) for m in model.modules())


def prepare(models: list[nn.Module], recipe: Recipe) -> Recipe:
    """Before fully_shard: each held base's codes and scales re-registered as frozen parameters (so
    FSDP2 shards them). Returns the recipe the ranks' forwards run with (train_quant off). Raises
    where a model still has a weight the recipe would quantize in its forward (nothing held it)."""
    for model in models:
        left = [name for name, p in model.named_parameters() if recipe.quantizes(name, p)]
        if left:
            raise ValueError(f"the FSDP trainer holds the frozen base quantized (QLoRA), but {len(left)} weights the "
                             f"recipe quantizes are not held so (e.g. {left[0]}): use trainer=torch")
        for module in model.modules():
            if isinstance(module, HOLDERS):
                for name, code in list(module._buffers.items()):
                    del module._buffers[name]
                    module._non_persistent_buffers_set.discard(name)
                    module.register_parameter(name, nn.Parameter(code, requires_grad=False))
    return replace(recipe, train_quant=NONE)


def _units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(prefix, module) covering the model once: each decoder layer (an FSDP unit of its own), then
    the root's other children (gathered with the root)."""
    layers = [(f"layers.{i}.", layer) for i, layer in enumerate(model.layers)]
    rest = [(f"{name}.", child) for name, child in model.named_children() if name != "layers"]
    return layers + rest


@torch.no_grad()
def gathered_state(model: nn.Module, writes: bool) -> dict[str, torch.Tensor]:
    """Collective: the policy's whole state dict on the CPU of the rank that `writes` ({} elsewhere),
    the held base dequantized as the 1-process trainer's state dict shows it. One FSDP unit gathered
    at a time (the root's, then each layer's), so no rank holds the whole base gathered.
    (get_model_state_dict cannot: it runs the holders' state-dict code on sharded codes.)"""
    if own := [k for k, v in model._parameters.items() if v is not None]:
        raise RuntimeError(f"gathered_state expects no parameter on the model itself: {own}")
    state: dict[str, torch.Tensor] = {}
    model.unshard()  # the root's parameters (embeddings, final norm, head), until the end
    try:
        for prefix, unit in _units(model):
            is_layer = prefix.startswith("layers.")
            if is_layer:
                unit.unshard()
            if writes:
                _dense_state(unit, prefix, state)
            if is_layer:
                unit.reshard()
    finally:
        model.reshard()
    return state


def _dense_state(module: nn.Module, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """module.state_dict(prefix) of a gathered unit, on the CPU. Not state_dict() itself: FSDP2's
    pre-hook on it puts the sharded parameters back first. The holders' own `_save_to_state_dict`
    writes the dequantized base."""
    own: dict[str, torch.Tensor] = {}
    module._save_to_state_dict(own, prefix, False)
    out.update({k: v.detach().cpu().clone() for k, v in own.items()})
    for name, child in module.named_children():
        _dense_state(child, f"{prefix}{name}.", out)


def base_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """The held base as this rank's shards (codes, scales, kept weights: DTensors) for a sharded
    resume checkpoint: the codes themselves, never quantized again."""
    return {name: p.detach() for name, p in model.named_parameters()}
