"""QLoRA on the Megatron-core trainer: the frozen base held as the engine's codes in its linears.

    codes = int4_codes(fp32_state, rows, recipe, device)                        # int4_qat
    codes = fp8_codes(native_fp32, rows, recipe, arch, te, round_trip, device)  # fp8 (w8a16)
    hold_base(gpt, codes, group)   # after the LoRA hooks, before DDP wraps `gpt` (the KL reference: copy=True)

Each local-spec linear whose rows the recipe all quantizes (quant.py `quantized_rows`) drops its dense
weight and holds codes and fp32 scales: INT4 packed two a byte with a scale per group of its input
(~0.53 bytes a weight), or FP8 e4m3 with a scale per 128 x 128 block (~1 byte), in place of 2 (bf16)
or 4 (fp32). The codes are computed once; the KL reference holds copies.

- INT4 groups run along each row's input, so quantizing GPTModel's fused q/k/v or gate/up weight row
  by row gives the codes the engine and trainer=torch hold for each native part.
- FP8 blocks are laid out on the native tensors. The native codes are moved as the weights are moved
  (`weights.to_megatron`), and each fused weight takes every 128th row of its rows' block scales. That
  is each Megatron block's scale only where no 128 x 128 block of the fused weight mixes native blocks
  (head_dim and the MLP width multiples of 128, as in the released models); the codes are held only
  where they dequantize to the dense round trip bit for bit, else the linear stays dense.

A linear with rows the recipe keeps stays dense (its round trip: quant.py). Forward: megatron-core's
frozen-weight product (matmul with the weight's transpose, + bias) on the codes dequantized to the
training dtype: the values of the dense round trip (one rounding of codes x scale), so log-probs and
adapter updates are the dense base's bit for bit. Backward: grad_input = grad_output @ W with W
dequantized again, so no dense weight is kept between forward and backward (megatron-core's
frozen-weight Function saves it). `weight` stays as a meta tensor of the dense shape for megatron-core's
shape checks; nothing reads its values. A state dict shows the dense `weight` (checkpoints, the merged
export map it as before); loading one checks it against the codes bit for bit and never quantizes
again (a resume of the same run).
"""

from __future__ import annotations

import torch

from miles.precision.fp8 import BLOCK, dequantize_fp8_weight, quantize_fp8_weight
from miles.precision.int4 import dequantize_int4, pack_int4, quantize_int4
from miles.precision.recipe import Recipe
from miles.trainer.megatron.weights import to_megatron

HELD = ("weight_codes", "weight_scales")


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
    if linear.held_group is None:  # FP8
        return dequantize_fp8_weight(linear.weight_codes, linear.weight_scales, dtype)
    return dequantize_int4(linear.weight_codes, linear.weight_scales, linear.held_group, k=linear.weight.shape[1],
                           dtype=dtype)


def _whole(rows: dict[str, torch.Tensor]) -> list[str]:
    """The Megatron weights whose rows the recipe all quantizes (a linear with kept rows stays dense)."""
    return [name for name, mask in rows.items() if bool(mask.all())]


def int4_codes(fp32_state: dict[str, torch.Tensor], rows: dict[str, torch.Tensor], recipe: Recipe,
               device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Megatron weight name -> (packed INT4 codes, group scales) of `fp32_state` (Megatron names) on
    `device`, for each wholly quantized weight."""
    out = {}
    for name in _whole(rows):
        codes, scales = quantize_int4(fp32_state[name].to(device, torch.float32), recipe.group)
        out[name] = (pack_int4(codes), scales)
    return out


@torch.no_grad()
def fp8_codes(native_fp32: dict[str, torch.Tensor], rows: dict[str, torch.Tensor], recipe: Recipe, arch, te: bool,
              round_trip: dict[str, torch.Tensor], device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Megatron weight name -> (e4m3 codes, 128 x 128 block scales) on `device`: the native tensors'
    (`native_fp32`, quantized as the engine does) moved as the weights are, for each wholly quantized
    weight they dequantize to `round_trip[name]` (quant.py `fp8_round_trip`, fp32) bit for bit."""
    codes, row_scales = {}, {}
    for name, t in native_fp32.items():
        if recipe.quantizes(name, t):
            q, s = quantize_fp8_weight(t)
            codes[name] = q.view(torch.uint8)  # moved as bytes
            row_scales[name] = s.repeat_interleave(BLOCK, dim=-2)[..., :t.shape[-2], :]  # each row its block's
        else:  # not held; expanded views cost nothing unless fused with a held part (then none is held)
            codes[name] = t if t.dim() < 2 else torch.zeros((), dtype=torch.uint8).expand(t.shape)
            row_scales[name] = t if t.dim() < 2 else torch.zeros(()).expand(*t.shape[:-1], -(-t.shape[-1] // BLOCK))
    codes, row_scales = to_megatron(codes, arch, te), to_megatron(row_scales, arch, te)
    out = {}
    for name in _whole(rows):
        q = codes[name].contiguous().view(torch.float8_e4m3fn)
        scales = row_scales[name][::BLOCK].contiguous()
        if torch.equal(dequantize_fp8_weight(q, scales, torch.float32), round_trip[name].float()):
            out[name] = (q.to(device), scales.to(device))
    return out


def hold_base(gpt: torch.nn.Module, codes: dict[str, tuple[torch.Tensor, torch.Tensor]], group: int | None,
              copy: bool = False) -> int:
    """Each local-spec linear of `gpt` named in `codes` (int4_codes: `group` its INT4 group; fp8_codes:
    None) drops its weight and holds them (copies with `copy`: a second model, offloaded on its own);
    returns how many linears now do."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    modules = dict(gpt.named_modules())
    held = 0
    for name, (q, scales) in codes.items():
        linear = modules.get(name.removesuffix(".weight"))
        if isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
            _hold(linear, q.clone() if copy else q, scales.clone() if copy else scales, group)
            held += 1
    return held


def held_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The codes and scales the held linears of `module` keep (what offload moves with the frozen base)."""
    return [getattr(m, n) for m in module.modules() if hasattr(m, "held_group") for n in HELD]


def _hold(linear, codes: torch.Tensor, scales: torch.Tensor, group: int | None) -> None:
    """`linear` drops its weight and holds `codes` / `scales` (INT4 groups of `group`; None: FP8)."""
    dense = linear.weight
    del linear.weight  # the Parameter: its storage goes with the last reference
    linear.register_buffer(HELD[0], codes, persistent=False)
    linear.register_buffer(HELD[1], scales, persistent=False)
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
        elif not torch.equal(state_dict[key].to(linear.weight_scales.device), _dense(linear, linear.weight.dtype)):
            error_msgs.append(f"{key}: differs from the frozen base this trainer holds as codes (a checkpoint of "
                              "another base?); a held base is never quantized again from a dense copy")
        rest = {k: v for k, v in state_dict.items() if k != key}
        type(linear)._load_from_state_dict(linear, rest, prefix, local_metadata, strict, missing_keys,
                                           unexpected_keys, error_msgs)

    linear._forward_impl, linear._save_to_state_dict, linear._load_from_state_dict = forward_impl, save, load
