"""QLoRA: a LoRA run's frozen base held in the rollout's quantized format in the trainer too.

    recipe = Recipe.from_cfg(cfg.precision, num_layers)
    if holds_quantized_base(recipe):          # precision=fp8 / int4_qat with trainer.lora
        quantize_frozen_base(model, recipe)   # each quantized nn.Linear -> FrozenQuantLinear, once
    lora = LoRA(model, ...)                   # the adapters hook the FrozenQuantLinear layers

The base never changes under LoRA, so the trainer quantizes it once, at build, to exactly what the
engine holds (`rollout_format` of the checkpoint's weights: FP8 e4m3 codes + fp32 128x128 block
scales, or packed INT4 + fp32 group scales), and drops the fp32 weights: ~1 or ~0.53 bytes per
weight instead of 4. Everything the recipe keeps in high precision (embeddings, head, norms,
routers, biases) stays as the recipe's training forward reads it: fp32. Stacked MoE experts are held
quantized by miles/models/frozen_experts.py (miles.precision does not import the model code).

Forward: the product the recipe's training forward computes without LoRA, on the same operands:
FP8 w8a8, the engine's FP8 GEMM on 1x128-quantized activations (`fp8_linear_with`, what
`fp8_train_linear` runs on the master weight's FP8 operand); INT4, `int4_linear` (dequantize to the
compute dtype, then F.linear: what `F.linear(x, fake_quant_int4(w))` computes, and the engine's
INT4 function); FP8 w8a16, `w8a16_linear` (F.linear on the dequantized weight, as the trainer's w8a16
forward). So a fresh adapter gives the recipe's own log-probs bit for bit. Backward:
grad_x = grad_y @ dequant(W) in the compute dtype, straight through the activation quantizer (as
`fp8_train_linear`), the dequantized weight rebuilt from the codes and dropped (never kept between
forward and backward); the base gets no gradient. The adapters' gradients reach earlier layers
through it.
"""

from __future__ import annotations

import torch
from torch import nn

from miles.precision.fp8 import dequantize_fp8_weight
from miles.precision.fp8_gemm import fp8_linear_with, prepare_fp8_weight
from miles.precision.fp8_w8a16_triton import w8a16_linear
from miles.precision.int4 import dequantize_int4, int4_linear
from miles.precision.recipe import FP8, NONE, W8A16, QuantLinear, Recipe
from miles.precision.rollout_format import rollout_format


def holds_quantized_base(recipe: Recipe) -> bool:
    """Whether a LoRA trainer holds its frozen base quantized: the training forward sees the
    rollout's quantization (fp8, int4_qat). Recipes that quantize only the rollout
    (bf16_train_*_rollout) train over a dense base: their trainer never sees the quantizer."""
    if recipe.train_quant == NONE:
        return False
    if recipe.train_quant != recipe.rollout_quant:
        raise ValueError(f"trainer.lora holds the frozen base in the rollout's format: precision.train_quant="
                         f"{recipe.train_quant} must equal precision.rollout_quant={recipe.rollout_quant}")
    return True


class _FrozenProduct(torch.autograd.Function):
    """y = the held base's product with x; grad_x = grad_y @ dequant(W), no gradient for the base."""

    @staticmethod
    def forward(ctx, x, bias, module: "FrozenQuantLinear"):
        ctx.module = module
        return module.product(x, bias)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = g @ ctx.module.dequantized(g.dtype)  # rebuilt here: the dense weight is never kept
        return grad_x.reshape(*grad.shape[:-1], grad_x.shape[-1]), None, None


class FrozenQuantLinear(QuantLinear):
    """The trainer's side of a quantized projection under QLoRA: the engine's payload tensors
    (QuantLinear's buffers), a differentiable input, a frozen weight.

    A state dict sees a dense base: `weight` is the dequantized weight (on the host: a dense copy of
    a base held quantized to save device memory does not belong on the device), so checkpoints and
    the merged export are plain HF weights. Loading a state dict does not quantize its weight again
    (that would round it a second time): it must equal the dequantized weight held, bit for bit,
    which it does for a resume checkpoint of the same run (its trainer quantized the same
    checkpoint the same way)."""

    def __init__(self, linear: nn.Linear, recipe: Recipe):
        super().__init__(linear, recipe.rollout_quant, recipe.group, recipe.fp8_backend, recipe.fp8_scheme)
        self.dense_dtype = linear.weight.dtype  # what a state dict shows: the master weights' dtype
        payload = rollout_format({"weight": linear.weight}, recipe.rollout_quant, lambda _: False, recipe.group)
        for name in self.buffer_names():
            setattr(self, name, payload[name])

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        # The compute dtype as fp8_train_linear / autocast's F.linear take it; the casts stay outside
        # the Function, so autograd returns x's gradient in x's own dtype.
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return _FrozenProduct.apply(x.to(dtype), bias, self)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] and bias in the compute dtype -> [..., N]: the recipe's training-forward product."""
        if self.quant == FP8 and self.fp8_scheme == W8A16:  # the trainer's w8a16 product, bf16 activations
            return w8a16_linear(x, self.weight, self.weight_scale_inv, bias)
        if self.quant == FP8:
            # Laid out per call (a view, or a padded copy where N, K are not multiples of 128): nothing
            # to go stale when the codes move to the host and back (trainer.offload).
            operand = prepare_fp8_weight(self.weight, self.weight_scale_inv, self.fp8_backend)
            return fp8_linear_with(x, operand, bias)
        return int4_linear(x, self.weight_packed, self.weight_scale, self.group, bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the codes hold, [N, K] in `dtype` (one rounding of the fp32 product)."""
        if self.quant == FP8:
            return dequantize_fp8_weight(self.weight, self.weight_scale_inv, dtype)
        return dequantize_int4(self.weight_packed, self.weight_scale, self.group, k=self.in_features, dtype=dtype)

    def held_bytes(self) -> int:
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in self.buffer_names())

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.dequantized(self.dense_dtype).cpu()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
        else:
            given, held = state_dict[key], self.dequantized(self.dense_dtype).cpu()
            if given.dtype != held.dtype or not torch.equal(given.cpu(), held):
                error_msgs.append(f"{key}: differs from the frozen base this trainer holds quantized (a checkpoint of "
                                  "another base?); a quantized base is never quantized again from a dense copy")
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


def quantize_frozen_base(model: nn.Module, recipe: Recipe) -> None:
    """Replace each nn.Linear the recipe quantizes by its FrozenQuantLinear, in place (the fp32
    weight is freed as each layer is replaced); the same layers the engine holds quantized."""
    found = recipe.quantized_linears(model)
    while found:  # popped, so no list keeps a replaced layer's fp32 weight alive
        parent, child_name, linear = found.pop()
        setattr(parent, child_name, FrozenQuantLinear(linear, recipe))


def frozen_quant_linears(model: nn.Module) -> dict[str, FrozenQuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FrozenQuantLinear)}
