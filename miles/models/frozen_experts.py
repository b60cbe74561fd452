"""QLoRA for stacked MoE experts: a LoRA run's frozen experts held in the rollout's quantized format.

    quantize_frozen_experts(model, recipe)   # each quantized expert stack -> its frozen holder, once

Under LoRA the base never changes, so the experts' fp32 tensors (most of a MoE model's weights) are
quantized once, to the payload the engine is sent (`rollout_format`: FP8 e4m3 codes + fp32 128x128
block scales per expert, or packed INT4 + fp32 group scales), and dropped. In the expert loop each
expert's slice is dequantized on use, to the values `Recipe.forward` gives the fp32 masters without
LoRA (`_fake_quant`: FP8 / INT4 round trip in the master dtype; FP8 w8a16: the compute dtype), so a
fresh adapter keeps the recipe's log-probs bit for bit, and the gradient reaching the activations is
the same product. The stack is never dequantized whole. A state dict shows the dense dequantized
tensors (checkpoints and the merged export stay plain HF weights), and loading one checks it equals
what is held (as `FrozenQuantLinear` does).

Backward, as `FrozenQuantLinear`'s: an expert's dequantized slice is not kept from its forward to its
backward. The expert loop (miles.models.moe / miles.models.llama4) multiplies the slice
`expert_weight` gives it by F.linear or @, which would make autograd save it (or autocast's copy of
it) as the matmul's operand: every routed expert's dense slice alive until the layer's backward.
`expert_weight` hands the loop a `_HeldExpert` instead, the same tensor tagged with where it came
from, whose product runs through `_ExpertProduct`: it saves nothing (the base gets no weight
gradient, so not even the input) and rebuilds the slice from the codes in backward for
grad_x = grad_y @ W_e, the product autograd's matmul backward computes, in the same dtype, so the
gradients are bit for bit those of the kept slice. The adapters' own products are untouched.

Two layouts, one holder (`FrozenStacks`): miles.models.moe.Experts ([E, 2I, H], [E, H, I]: F.linear)
-> FrozenQuantExperts; Llama 4's transposed stacks (miles.models.llama4.Llama4Experts, [E, H, 2I] and
[E, I, H]: x @ W_e) -> FrozenQuantLlama4Experts. The payload is the stack as it is stored, so it
is quantized over its own last two dims, whichever is the input: rollout_format treats any 3-D
tensor as [..., N, K] (FP8 blocks over the last two dims, INT4 groups along the last), and the
engine rebuilds Llama 4's experts from exactly that. On Llama 4 the INT4 groups therefore run along
the output dim (2I of gate_up_proj, H of down_proj), not the input's as in a projection: the held
codes are the engine's, bit for bit, which is what the trainer has to multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.models.llama4 import Llama4Experts
from miles.models.moe import Experts
from miles.models.quant_experts import STACKED, QuantStacks
from miles.precision.recipe import FP8, W8A16, Recipe
from miles.precision.rollout_format import rollout_format


class _ExpertProduct(torch.autograd.Function):
    """One expert's product with its tokens, x [c, in] -> [c, out]: F.linear(x, W_e) on [out, in]
    stacks, x @ W_e on Llama 4's [in, out] ones, W_e the dequantized slice; what the expert loop's own
    call computes (under the caller's autocast). Backward: grad_x = grad_y @ W_e (@ W_e^T transposed),
    W_e rebuilt from the codes and dropped; no gradient for the base."""

    @staticmethod
    def forward(ctx, x, weight, holder, name, e, transposed):
        y = x @ weight if transposed else F.linear(x, weight)
        # The matmul ran in y's dtype: the slice as dequantized (weight.dtype), cast by autocast if it
        # was on; x's gradient goes back in x's dtype, as autocast's cast of x passes it.
        ctx.source = holder, name, e, weight.dtype, y.dtype, x.dtype, transposed
        return y

    @staticmethod
    def backward(ctx, grad):
        holder, name, e, dequantized, compute, x_dtype, transposed = ctx.source
        weight = holder._dequantize(name, e, dequantized).to(compute)
        grad_x = grad @ (weight.t() if transposed else weight)
        return grad_x.to(x_dtype), None, None, None, None, None


# The expert loops' products of x by an expert's slice -> whether the slice is [in, out] (x @ W).
_PRODUCTS = {F.linear: False, torch.Tensor.matmul: True}  # `x @ W` reaches __torch_function__ as matmul


class _HeldExpert(torch.Tensor):
    """Expert e's dequantized slice as `expert_weight` gives it to the expert loop (the same storage):
    its product with the tokens runs through _ExpertProduct, which does not keep it for backward. Any
    other use sees the plain tensor. A tensor subclass, so that the expert loops stay the dense
    experts' own code: only what the holder hands them changes how they multiply it."""

    @staticmethod
    def __new__(cls, weight: torch.Tensor, holder: "FrozenStacks", name: str, e: int):
        held = torch.Tensor._make_subclass(cls, weight)
        held.dense, held.source = weight, (holder, name, e)
        return held

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _PRODUCTS and not kwargs and len(args) == 2 and isinstance(args[1], cls) \
                and not isinstance(args[0], cls):
            x, held = args
            return _ExpertProduct.apply(x, held.dense, *held.source, _PRODUCTS[func])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class FrozenStacks(QuantStacks):
    """The frozen holders: the stacks quantized once from the dense experts (the engine's payload, bit
    for bit), slices handed to the expert loop as `_HeldExpert`s."""

    def _hold(self, experts: torch.nn.Module, recipe: Recipe) -> None:
        self._init_stacks(experts, recipe.rollout_quant, recipe.group)
        self.fp8_scheme = recipe.fp8_scheme
        for name in STACKED:
            payload = rollout_format({name: getattr(experts, name).detach()}, recipe.rollout_quant, lambda _: False,
                                     recipe.group)
            for key, t in payload.items():
                self.register_buffer(key, t)

    def _code(self) -> torch.Tensor:
        return getattr(self, "gate_up_proj" if self.quant == FP8 else "gate_up_proj_packed")

    def expert_weight(self, name: str, e: int) -> torch.Tensor:
        # Recipe._fake_quant's dtype: the master dtype, or for w8a16 the compute dtype (autocast's).
        dtype = self.dense_dtype
        if self.quant == FP8 and self.fp8_scheme == W8A16:
            device = self._code().device.type
            if torch.is_autocast_enabled(device):
                dtype = torch.get_autocast_dtype(device)
        return _HeldExpert(self._dequantize(name, e, dtype), self, name, e)

    def dequantized(self, name: str) -> torch.Tensor:
        """The whole stacked tensor in the master dtype, as stored (state dicts, exports)."""
        return self._dequantize(name, slice(None), self.dense_dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in STACKED:
            destination[prefix + name] = self.dequantized(name).cpu()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name in STACKED:
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            given, held = state_dict[key], self.dequantized(name).cpu()
            if given.dtype != held.dtype or not torch.equal(given.cpu(), held):
                error_msgs.append(f"{key}: differs from the frozen experts this trainer holds quantized (a checkpoint "
                                  "of another base?); a quantized base is never quantized again from a dense copy")


class FrozenQuantExperts(FrozenStacks, Experts):
    """miles.models.moe.Experts held quantized ([E, out, in] stacks)."""

    def __init__(self, experts: Experts, recipe: Recipe):
        self._hold(experts, recipe)


class FrozenQuantLlama4Experts(FrozenStacks, Llama4Experts):
    """Llama 4's transposed stacks held quantized ([E, in, out], multiplied as x @ W_e)."""

    def __init__(self, experts: Llama4Experts, recipe: Recipe):
        self._hold(experts, recipe)


HOLDER = {Experts: FrozenQuantExperts, Llama4Experts: FrozenQuantLlama4Experts}


def quantized_stacks(model: torch.nn.Module, recipe: Recipe) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each expert stack, either layout, whose tensors the recipe quantizes: the
    experts the engine is sent quantized (works on a meta-device model: the planner's count)."""
    return [(name, m) for name, m in model.named_modules()
            if type(m) in HOLDER and all(recipe.quantizes(f"{name}.{t}", getattr(m, t)) for t in STACKED)]


def quantize_frozen_experts(model: torch.nn.Module, recipe: Recipe) -> None:
    """Replace each expert stack the recipe quantizes by its frozen holder, in place (the fp32
    stacks freed as each is replaced)."""
    found = quantized_stacks(model, recipe)
    while found:
        name, experts = found.pop()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, HOLDER[type(experts)](experts, recipe))
