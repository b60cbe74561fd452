"""MoE expert stacks held in the rollout's quantized format: the engine's, under the FP8 / INT4 recipes.

    quantize_engine_experts(model, recipe)    # each quantized stack -> an empty holder
    recipe.load_engine(model, payload, dtype) # fills it with the payload's codes and scales, in place

The stacked experts are most of a MoE model's weights, and weight sync sends them quantized
(`rollout_format`: FP8 e4m3 codes + fp32 128x128 block scales per expert, or packed INT4 + fp32 group
scales). The engine keeps them so (1 or 1/2 byte a weight, not the engine dtype's 2), which is what the
memory planner counts, and multiplies them two ways, with the same bits:

- slot decode on CUDA: the grouped Triton kernels (miles.models.moe_grouped) read the codes and scales
  and dequantize each weight as they load it; decode is bound by the bytes of the experts it reads
  (`moe_grouped.CODES_ON_CUDA` turns this off, to compare);
- everything else (prefill, the CPU, true on-policy's batch-invariant kernels): the expert loop of the
  dense class, which asks `expert_weight(name, e)` for one expert's slice, dequantized on use.

Either way a weight is code x scale in fp32 rounded once to the engine dtype: `from_rollout_format`'s
value, which the engine held dense before, and the trainer's fake-quantized weight.

`QuantStacks` is shared with QLoRA's frozen holders (miles/models/frozen_experts.py), which hold the
trainer's frozen base the same way.
"""

from __future__ import annotations

import torch

from miles.models.llama4 import Llama4Experts
from miles.models.moe import Experts
from miles.models.moe_grouped import Stack
from miles.precision.fp8 import dequantize_fp8_weight
from miles.precision.int4 import dequantize_int4
from miles.precision.recipe import EXPERT_STACKS as STACKED
from miles.precision.recipe import FP8, NONE, Recipe, stack_payload_names


class QuantStacks:
    """Mixin of the quantized holders: buffers `<stack>` + `<stack>_scale_inv` (FP8) or `<stack>_packed`
    + `<stack>_scale` (INT4), no parameters. Placed before the experts class, whose forward reads each
    expert's slice through `expert_weight`."""

    held_quantized = True

    def _init_stacks(self, experts: torch.nn.Module, quant: str, group: int) -> None:
        torch.nn.Module.__init__(self)
        self.num_experts = experts.num_experts
        self.lora_hooks = experts.lora_hooks
        self.quant, self.group = quant, group
        self.dense_dtype = experts.gate_up_proj.dtype
        self._shapes = {name: getattr(experts, name).shape for name in STACKED}

    def stacked_shape(self, name: str) -> torch.Size:
        return self._shapes[name]

    def _dequantize(self, name: str, index, dtype: torch.dtype) -> torch.Tensor:
        if self.quant == FP8:
            return dequantize_fp8_weight(getattr(self, name)[index], getattr(self, f"{name}_scale_inv")[index], dtype)
        return dequantize_int4(getattr(self, f"{name}_packed")[index], getattr(self, f"{name}_scale")[index], self.group,
                               k=self._shapes[name][-1], dtype=dtype)

    def stack(self, name: str) -> Stack:
        """The stacked tensor `name` as the grouped kernels read it."""
        if self.quant == FP8:
            return Stack(getattr(self, name), getattr(self, f"{name}_scale_inv"), "fp8")
        return Stack(getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"), "int4", self.group)

    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class EngineStacks(QuantStacks):
    """The engine's holder: empty placeholders until load_engine copies the payload in (in place from the
    second sync on: a captured CUDA graph keeps reading these buffers). Not in the state dict, as the
    engine's QuantLinear buffers are not: `Recipe.held_tensors` reports them."""

    holds_payload = True  # Recipe.load_engine / held_tensors find the holders by this

    def _hold(self, experts: torch.nn.Module, recipe: Recipe) -> None:
        self._init_stacks(experts, recipe.rollout_quant, recipe.group)
        for name in self.buffer_names():
            self.register_buffer(name, torch.empty(0, device=experts.gate_up_proj.device), persistent=False)

    def buffer_names(self) -> tuple[str, ...]:
        return tuple(n for stack in STACKED for n in stack_payload_names(stack, self.quant))

    def refresh(self) -> None:
        """After the payload changed: nothing to lay out (the kernels read the payload as it is)."""

    def expert_weight(self, name: str, e: int) -> torch.Tensor:
        return self._dequantize(name, e, self.dense_dtype)


class EngineQuantExperts(EngineStacks, Experts):
    """miles.models.moe.Experts held quantized ([E, out, in] stacks): the grouped kernels in slot decode."""

    def __init__(self, experts: Experts, recipe: Recipe):
        self._hold(experts, recipe)


class EngineQuantLlama4Experts(EngineStacks, Llama4Experts):
    """Llama 4's transposed stacks ([E, in, out], x @ W_e) held quantized: the expert loop."""

    def __init__(self, experts: Llama4Experts, recipe: Recipe):
        self._hold(experts, recipe)


ENGINE_HOLDER = {Experts: EngineQuantExperts, Llama4Experts: EngineQuantLlama4Experts}


def quantize_engine_experts(model: torch.nn.Module, recipe: Recipe) -> None:
    """Replace each expert stack the recipe sends quantized by an empty engine holder, in place (the dense
    stacks freed as each is replaced); Recipe.load_engine fills the holders."""
    if recipe.rollout_quant == NONE:
        return
    found = [(name, m) for name, m in model.named_modules()
             if type(m) in ENGINE_HOLDER and recipe.holds_stacks_quantized(name)]
    while found:
        name, experts = found.pop()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, ENGINE_HOLDER[type(experts)](experts, recipe))
