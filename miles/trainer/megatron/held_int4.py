"""QLoRA under int4_qat on the Megatron-core trainer: the frozen base held as INT4 codes in its linears.

    hold_int4_base(gpt, fp32_state, rows, recipe)   # after the LoRA hooks, before DDP wraps `gpt`

Each local-spec linear whose rows the recipe all quantizes (quant.py `quantized_rows`) drops its dense
weight and holds the packed INT4 codes and fp32 group scales of the checkpoint's fp32 weight: ~0.53
bytes a weight in place of 2 (bf16) or 4 (fp32). INT4 groups run along the input dim of each row, so
quantizing GPTModel's fused q/k/v or gate/up weight row by row quantizes each native part as the
engine and trainer=torch do: the same codes. A linear with rows the recipe keeps stays dense (its
round trip, quant.py `int4_base`).

Forward: Megatron's frozen-weight product (`linear_with_frozen_weight`: matmul with the weight's
transpose, + bias) on the codes dequantized to the training dtype, the values the dense round trip
held (one rounding of codes x scale), so log-probs and adapter updates are those of the dense base bit
for bit. Backward: grad_input = grad_output @ W, W dequantized again there: the dense weight is never
kept between forward and backward (megatron-core's frozen-weight Function saves it). `weight` stays
as a meta tensor of the dense shape, for megatron-core's shape checks; nothing reads its values.
A state dict shows the dense `weight` (checkpoints, the merged export map it as before); loading one
checks it against the codes bit for bit and never quantizes again (a resume of the same run).

FP8 (fp8_scheme w8a16) keeps its dense round trip: its 128 x 128 blocks are laid out on the native
tensors, whose rows GPTModel interleaves per query group, so a fused weight's blocks are not the
engine's blocks.
"""

from __future__ import annotations

import torch

from miles.precision.int4 import dequantize_int4, pack_int4, quantize_int4
from miles.precision.recipe import Recipe

HELD = ("weight_packed", "weight_scale")


class _HeldProduct(torch.autograd.Function):
    """y = x @ dequant(W).T (+ bias); grad_x = grad_y @ dequant(W), dequantized again; no weight grad."""

    @staticmethod
    def forward(ctx, x, bias, linear):
        ctx.linear = linear
        out = torch.matmul(x, _dense(linear, x.dtype).t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        w = _dense(ctx.linear, grad.dtype)
        # as megatron-core's frozen-weight backward: leading dims folded to one matmul
        grad_x = grad.reshape(-1, grad.shape[-1]).matmul(w).reshape(*grad.shape[:-1], w.shape[1])
        return grad_x, None, None


def _dense(linear, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_int4(linear.weight_packed, linear.weight_scale, linear.held_group, k=linear.weight.shape[1],
                           dtype=dtype)


def hold_int4_base(gpt: torch.nn.Module, fp32_state: dict[str, torch.Tensor], rows: dict[str, torch.Tensor],
                   recipe: Recipe) -> int:
    """Hold each wholly quantized linear weight of `gpt` as INT4 codes (from `fp32_state`, Megatron
    names); returns how many linears now do."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    modules = dict(gpt.named_modules())
    held = 0
    for name, mask in rows.items():
        linear = modules.get(name.removesuffix(".weight"))
        if bool(mask.all()) and isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
            _hold(linear, fp32_state[name], recipe.group)
            held += 1
    return held


def held_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The codes and scales the held linears of `module` keep (what offload moves with the frozen base)."""
    return [t for m in module.modules() if hasattr(m, "held_group") for t in (m.weight_packed, m.weight_scale)]


def _hold(linear, w32: torch.Tensor, group: int) -> None:
    dense = linear.weight
    codes, scales = quantize_int4(w32.to(dense.device, torch.float32), group)
    del linear.weight  # the Parameter: its storage goes with the last reference
    linear.register_buffer("weight_packed", pack_int4(codes), persistent=False)
    linear.register_buffer("weight_scale", scales, persistent=False)
    linear.weight = torch.empty(dense.shape, dtype=dense.dtype, device="meta")
    linear.held_group = group

    def forward_impl(input, weight, bias, *args, **kwargs):  # megatron-core's _forward_impl signature
        return _HeldProduct.apply(input, bias, linear)

    def save(destination, prefix, keep_vars):
        destination[prefix + "weight"] = _dense(linear, linear.weight.dtype)  # first, where the Parameter was
        type(linear)._save_to_state_dict(linear, destination, prefix, keep_vars)  # bias, extra state

    def load(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
        elif not torch.equal(state_dict[key].to(linear.weight_scale.device), _dense(linear, linear.weight.dtype)):
            error_msgs.append(f"{key}: differs from the frozen base this trainer holds as INT4 codes (a checkpoint of "
                              "another base?); a held base is never quantized again from a dense copy")
        rest = {k: v for k, v in state_dict.items() if k != key}
        type(linear)._load_from_state_dict(linear, rest, prefix, local_metadata, strict, missing_keys,
                                           unexpected_keys, error_msgs)

    linear._forward_impl, linear._save_to_state_dict, linear._load_from_state_dict = forward_impl, save, load
