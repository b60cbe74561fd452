"""A precision recipe applied to a model, the same way on the training and the rollout side.

    recipe = Recipe.from_cfg(cfg.precision, num_layers)
    trainer:  logits = recipe.forward(model, tokens)          # fake-quantized weights (STE), fp8 activations
              payload = recipe.sync_payload(model.state_dict())  # what weight sync carries
    engine:   recipe.prepare_engine(model)                     # quantized nn.Linear -> QuantLinear
              recipe.load_engine(model, payload, dtype)        # install the payload
              recipe.held_checksum(model) == recipe.expected_checksum(payload, model, dtype)

One quantizer serves both sides (`miles.precision`). The engine keeps each quantized `nn.Linear` in
the payload's own format (FP8 + block scales, or packed INT4 + group scales), laid out for its GEMM
once per sync, and multiplies through `fp8_linear_with` (emulated on CPU, `torch._scaled_mm` on
Hopper, DeepGEMM where it loads) or `int4_linear_auto` (a fused W4A16 Triton kernel on CUDA). On the
training side an FP8 nn.Linear runs that same FP8 GEMM on the same operands (`fp8_train_linear`:
the engine's bits for the same input, a bf16 backward), and every other quantized weight (INT4
QAT, stacked MoE experts, which the engine holds quantized and dequantizes on use:
miles/models/quant_experts.py) is `dequantize(quantize(w))` through the very functions the engine
dequantizes its weights with. So the two sides multiply the same numbers
with the same arithmetic. Under LoRA (QLoRA, miles/precision/qlora.py) the trainer holds its frozen
base's quantized layers as the engine does, a QuantLinear subclass with a straight-through backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from miles.precision import dense_copy, invariance
from miles.precision.dense_copy import dequantized
from miles.precision.fake_quant import fake_quant_fp8_weight, fake_quant_int4
from miles.precision.fp8_gemm import FP8Operand, fp8_linear_with, prepare_fp8_weight
from miles.precision.fp8_train import (FP8WeightCache, fp8_train_linear, straight_through_dequantized,
                                      w8a16_train_linear)
from miles.precision.fp8_w8a16_triton import w8a16_linear, w8a16_linear_auto
from miles.precision.int4 import int4_linear
from miles.precision.int4_triton import int4_linear_auto
from miles.precision.rollout_format import (FP8_SCALE_SUFFIX, from_rollout_format, high_precision_predicate,
                                            rollout_checksum, rollout_format)

NONE, FP8, INT4 = "none", "fp8", "int4"
EXPERT_STACKS = ("gate_up_proj", "down_proj")  # a MoE layer's stacked expert tensors (miles.models.moe)
W8A8, W8A16 = "w8a8", "w8a16"  # precision.fp8_scheme


class QuantLinear(nn.Module):
    """The rollout side of a quantized nn.Linear: holds the payload tensors, multiplies through them.

    fp8: `weight` (e4m3 [N, K]) and `weight_scale_inv` (fp32 128x128 block scales), activations
    quantized in 1x128 tiles (fp8_scheme w8a8) or kept in high precision (w8a16); int4: `weight_packed`
    (uint8 [N, K/2]), `weight_scale` (fp32 per group), activations in high precision (W4A16).
    """

    holds_payload = True  # load_engine / held_tensors find the payload's holders by this (MoE stacks too)

    def __init__(self, linear: nn.Linear, quant: str, group: int, fp8_backend: str = "auto",
                 fp8_scheme: str = W8A8):
        super().__init__()
        self.quant, self.group, self.fp8_backend, self.fp8_scheme = quant, group, fp8_backend, fp8_scheme
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias  # biases travel unquantized (1-D)
        for name in self.buffer_names():
            self.register_buffer(name, torch.empty(0), persistent=False)
        self.operand: FP8Operand | None = None  # fp8: the payload laid out for the GEMM (refresh)
        self.dense_dtype: torch.dtype | None = None  # set by hold_dense_copy: the `dense` buffer's dtype

    def buffer_names(self) -> tuple[str, ...]:
        """The payload's tensors (what a sync carries and the checksum covers)."""
        return payload_names(self.quant)

    def held_names(self) -> tuple[str, ...]:
        """Every buffer the layer holds: the payload, and the dense copy when it keeps one."""
        return self.buffer_names() + (("dense",) if self.dense_dtype is not None else ())

    def hold_dense_copy(self, dtype: torch.dtype) -> None:
        """Keep a dequantized copy of a weight-only payload in `dtype` (miles/precision/dense_copy.py),
        made at each refresh; calls of many rows multiply it with cuBLAS."""
        if self.quant == FP8 and self.fp8_scheme != W8A16:
            raise ValueError("a dense copy is for weight-only layers (FP8 w8a16, INT4); w8a8 multiplies FP8 operands")
        self.dense_dtype = dtype
        self.register_buffer("dense", torch.empty(0), persistent=False)
        if self.buffer_names() and getattr(self, self.buffer_names()[0]).numel():
            self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """After the payload changed: lay the FP8 weight out for its GEMM backend, in place where a
        layout exists already (a captured CUDA graph reads these addresses). A weight-only layer holding
        a dense copy dequantizes its payload into it, in place too."""
        if self.dense_dtype is not None:
            q, scale = (getattr(self, n) for n in self.buffer_names())
            new = dequantized(q, scale, self.quant, self.group, self.in_features, self.dense_dtype)
            if self.dense.shape == new.shape:
                self.dense.copy_(new)
            else:  # the first load replaces the empty placeholder
                self.dense = new
        if self.quant != FP8 or self.fp8_scheme == W8A16:  # w8a16 reads the payload as it is
            return
        new = prepare_fp8_weight(self.weight, self.weight_scale_inv, self.fp8_backend)
        old = self.operand
        if old is None or old.mm is None or new.mm is None or old.backend != new.backend \
                or old.mm.q.shape != new.mm.q.shape or old.mm.scale_b.shape != new.mm.scale_b.shape:
            self.operand = new
            return
        if old.mm.q.data_ptr() != new.mm.q.data_ptr():  # padded: a copy of its own
            old.mm.q.copy_(new.mm.q)
        old.mm.scale_b.copy_(new.mm.scale_b)
        self.operand = old._replace(q=self.weight, scale=self.weight_scale_inv)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # True on-policy runs the engine under the trainer's autocast: quantize and multiply the
            # activations in the autocast dtype, as the trainer's fp8_train_linear and F.linear do.
            x = x.to(torch.get_autocast_dtype(device))
        # (hold_dense_copy takes weight-only layers only)
        if self.dense_dtype is not None and not invariance.active() and dense_copy.applies(x, self.dense):
            return F.linear(x, self.dense, self.bias)  # the one-pass path's bits, its dequantization done once
        if self.quant == FP8 and self.fp8_scheme == W8A16:
            if invariance.active():  # F.linear on the dequantized weight: the invariant matmul, as the trainer's
                return w8a16_linear(x, self.weight, self.weight_scale_inv, self.bias)
            return w8a16_linear_auto(x, self.weight, self.weight_scale_inv, self.bias)
        if self.quant == FP8:
            if self.operand is None:
                self.refresh()
            return fp8_linear_with(x, self.operand, self.bias)
        if invariance.active():  # the dequantized weight through the invariant matmul, as the trainer's QAT
            return int4_linear(x, self.weight_packed, self.weight_scale, self.group, self.bias)
        return int4_linear_auto(x, self.weight_packed, self.weight_scale, self.group, self.bias)


def payload_names(quant: str) -> tuple[str, ...]:
    """The tensors a quantized Linear weight travels as (rollout_format's names, minus metadata)."""
    return stack_payload_names("weight", quant)


def stack_payload_names(name: str, quant: str) -> tuple[str, ...]:
    """The tensors the quantized weight `name` travels as (rollout_format's, minus INT4's `_shape`)."""
    return (name, name + FP8_SCALE_SUFFIX) if quant == FP8 else (name + "_packed", name + "_scale")


@dataclass
class Recipe:
    train_quant: str  # fake quantization in the training forward: none, fp8, int4
    rollout_quant: str  # what the engine holds: none (the rollout dtype), fp8, int4
    group: int  # int4 group size
    keep: Callable[[str], bool]  # True: never quantized (embeddings, head, norms, routers, chosen layers)
    # precision.forward_weights=rollout: the dtype the forward casts the master weights to (None: master).
    forward_dtype: torch.dtype | None = None
    fp8_backend: str = "auto"  # precision.fp8_gemm: the FP8 GEMM both sides run
    fp8_scheme: str = W8A8  # precision.fp8_scheme: w8a8 (FP8 activations too) or w8a16 (weights only)
    fp8_backward: bool = False  # precision.fp8_backward=fp8: the FP8 linears' dgrad / wgrad in FP8
    # The training forward's FP8 operands, made once per optimizer step (see release_training_cache).
    fp8_cache: FP8WeightCache = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.fp8_cache = FP8WeightCache(self.fp8_backend)

    @classmethod
    def from_cfg(cls, precision, num_layers: int) -> "Recipe":
        keep = high_precision_predicate(precision.keep_high_precision, precision.keep_first_layers,
                                        precision.keep_last_layers, num_layers)
        forward_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision.rollout_dtype.value] \
            if precision.forward_weights == "rollout" else None
        return cls(precision.train_quant.value, precision.rollout_quant.value, precision.int4_group_size, keep,
                   forward_dtype, precision.fp8_gemm.value, precision.fp8_scheme.value,
                   precision.fp8_backward.value == "fp8")

    def quantizes(self, name: str, tensor: torch.Tensor) -> bool:
        return tensor.is_floating_point() and tensor.dim() >= 2 and not self.keep(name)

    # ---- training side ----
    def forward(self, model: nn.Module, *args, **kwargs) -> torch.Tensor:
        """model(*args, **kwargs) with the recipe's training-side quantization (gradients pass
        straight through to the fp32 master weights). fp8 w8a8: each selected nn.Linear runs the
        engine's FP8 GEMM (fp8_train_linear); the other selected weights (stacked MoE experts), and
        all of them with int4, are fake-quantized, as the engine rebuilds them. fp8 w8a16: every
        selected weight is its dequantized copy, made once per optimizer step (F.linear then
        multiplies what the engine's W8A16 GEMM multiplies)."""
        if self.train_quant == NONE and self.forward_dtype is None:
            return model(*args, **kwargs)
        fp8_linears = {}
        if self.train_quant == FP8 and (self.fp8_scheme == W8A8 or self.fp8_backward):
            fp8_linears = {name: m for name, m in model.named_modules()
                           if isinstance(m, nn.Linear) and self.quantizes(f"{name}.weight", m.weight)}
        weights = {}
        if self.forward_dtype is not None:  # differentiable casts: the gradients reach the fp32 masters
            weights = {name: p.to(self.forward_dtype) for name, p in model.named_parameters()
                       if p.is_floating_point() and name.rpartition(".")[0] not in fp8_linears}
        if self.train_quant != NONE:
            weights.update({name: self._fake_quant(p) for name, p in model.named_parameters()
                            if self.quantizes(name, p) and name.rpartition(".")[0] not in fp8_linears})
        for module in fp8_linears.values():
            module.forward = (functools.partial(_fp8_linear_forward, module, self.fp8_cache, self.fp8_backward)
                              if self.fp8_scheme == W8A8 else
                              functools.partial(_w8a16_linear_forward, module, self.fp8_cache, self.forward_dtype))
        try:
            return torch.func.functional_call(model, weights, args, kwargs, strict=False) if weights \
                else model(*args, **kwargs)
        finally:
            for module in fp8_linears.values():
                del module.forward

    def release_training_cache(self) -> None:
        """Free the training forward's FP8 operands (the trainer calls this when a train step ends
        and before it offloads; the next forward quantizes the weights again)."""
        self.fp8_cache.clear()

    def _fake_quant(self, w: torch.Tensor) -> torch.Tensor:
        # From the master weight (as the payload is), rounded once to the forward's dtype.
        dtype = self.forward_dtype or w.dtype
        if self.train_quant == FP8 and self.fp8_scheme == W8A16:
            # The compute dtype's copy (autocast would round the fake-quantized fp32 weight to it anyway).
            device = w.device.type
            dtype = self.forward_dtype or (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                                           else w.dtype)
            return straight_through_dequantized(w, self.fp8_cache, dtype)
        return fake_quant_fp8_weight(w, dtype=dtype) if self.train_quant == FP8 else fake_quant_int4(w, self.group, dtype)

    def sync_payload(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What weight sync carries: the rollout format of the trainer's (master) weights."""
        return rollout_format(state_dict, self.rollout_quant, self.keep, self.group)

    def holds_stacks_quantized(self, prefix: str) -> bool:
        """Whether the engine holds the MoE expert stacks at `prefix` (gate_up_proj, down_proj) in the
        payload's format (miles/models/quant_experts.py): both travel quantized."""
        return self.rollout_quant != NONE and not any(self.keep(f"{prefix}.{t}") for t in EXPERT_STACKS)

    # ---- rollout side ----
    def prepare_engine(self, model: nn.Module) -> None:
        """Replace each quantized nn.Linear by a QuantLinear (its payload arrives with load_engine); the
        engine replaces its expert stacks too (miles.models.quant_experts.quantize_engine_experts)."""
        if self.rollout_quant == NONE:
            return
        for parent, child_name, linear in self.quantized_linears(model):
            setattr(parent, child_name, QuantLinear(linear, self.rollout_quant, self.group, self.fp8_backend,
                                                    self.fp8_scheme))

    def quantized_linears(self, model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
        """(parent, attribute name, layer) of each nn.Linear whose weight the rollout format quantizes
        (the engine's QuantLinear layers; a QLoRA trainer's FrozenQuantLinear ones)."""
        found = []
        for name, module in model.named_modules():
            for child_name, child in module.named_children():
                full = f"{name}.{child_name}" if name else child_name
                if isinstance(child, nn.Linear) and self.quantizes(f"{full}.weight", child.weight):
                    found.append((module, child_name, child))
        return found

    def load_engine(self, model: nn.Module, payload: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Install a sync payload: the holders (QuantLinear layers, quantized expert stacks) take their
        tensors as they are; everything else (kept tensors, biases) is rebuilt dense in the engine's dtype."""
        holders = self._holders(model)
        held, dense = self._split(payload, {p: m.buffer_names() for p, m in holders.items()}, dtype)
        missing, unexpected = model.load_state_dict(dense, strict=False)
        if missing or unexpected:
            raise ValueError(f"sync payload does not match the engine: missing {missing}, unexpected {unexpected}")
        device = _device(model)
        for prefix, module in holders.items():
            for buffer in module.buffer_names():
                new, old = held[f"{prefix}.{buffer}"], getattr(module, buffer)
                if old.shape == new.shape and old.dtype == new.dtype:
                    old.copy_(new)  # in place: a captured CUDA graph keeps reading this buffer
                else:  # the first load replaces the empty placeholder
                    setattr(module, buffer, new.to(device))
            module.refresh()

    def held_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """What the engine holds: its holders' payload tensors and its dense state."""
        held = dict(model.state_dict())
        for prefix, module in self._holders(model).items():
            held.update({f"{prefix}.{b}": getattr(module, b) for b in module.buffer_names()})
        return held

    def held_checksum(self, model: nn.Module) -> str:
        return rollout_checksum(self.held_tensors(model))

    def expected_tensors(self, payload: dict[str, torch.Tensor], model: nn.Module,
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """What held_tensors must give after load_engine(payload), computed by either side from the
        payload (`model`: the trainer's or the engine's, to tell which Linear layers the engine holds
        quantized)."""
        held, dense = self._split(payload, self.held_layout(model), dtype)
        return {**held, **dense}

    def expected_checksum(self, payload: dict[str, torch.Tensor], model: nn.Module, dtype: torch.dtype) -> str:
        return rollout_checksum(self.expected_tensors(payload, model, dtype))

    def _split(self, payload, layout: dict[str, tuple[str, ...]], dtype) -> tuple[dict, dict]:
        """(payload tensors the holders keep as they are, dense state of the rest); layout: held_layout's."""
        held_keys = {f"{p}.{b}" for p, names in layout.items() for b in names}
        # INT4 metadata (the weight's shape), implied by the holder
        extra = {f"{p}.{b[:-len('_packed')]}_shape" for p, names in layout.items() for b in names if b.endswith("_packed")}
        held = {k: payload[k] for k in held_keys}
        rest = {k: v for k, v in payload.items() if k not in held_keys and k not in extra}
        dense = {k: v.to(dtype) if v.is_floating_point() else v
                 for k, v in from_rollout_format(rest, self.rollout_quant, dtype, self.group).items()}
        return held, dense

    def held_layout(self, model: nn.Module) -> dict[str, tuple[str, ...]]:
        """What the engine holds in the payload's format, module prefix -> tensor names: on the engine's
        model its holders; on the trainer's the nn.Linear layers prepare_engine would replace and the
        expert stacks the engine holds quantized (modules with `stacked_shape`: dense stacks or QLoRA's)."""
        if self.rollout_quant == NONE:
            return {}
        layout = {}
        for name, m in model.named_modules():
            if getattr(m, "holds_payload", False):
                layout[name] = m.buffer_names()
            elif isinstance(m, nn.Linear) and self.quantizes(f"{name}.weight", m.weight):
                layout[name] = payload_names(self.rollout_quant)
            elif callable(getattr(m, "stacked_shape", None)) and self.holds_stacks_quantized(name):
                layout[name] = tuple(n for t in EXPERT_STACKS for n in stack_payload_names(t, self.rollout_quant))
        return layout

    @staticmethod
    def _holders(model: nn.Module) -> dict[str, nn.Module]:
        return {name: m for name, m in model.named_modules() if getattr(m, "holds_payload", False)}


def _fp8_linear_forward(module: nn.Linear, cache: FP8WeightCache, fp8_backward: bool, x: torch.Tensor) -> torch.Tensor:
    # Under autocast the input is quantized in the autocast dtype, as the engine quantizes its bf16
    # activations, rather than in the fp32 values autocast would round again afterwards.
    return fp8_train_linear(x, module.weight, module.bias, cache, fp8_backward)


def _w8a16_linear_forward(module: nn.Linear, cache: FP8WeightCache, dtype: torch.dtype | None,
                          x: torch.Tensor) -> torch.Tensor:
    # w8a16 under the FP8 backward: the plain path's forward bits (_fake_quant's weight, the bias in
    # the forward dtype as functional_call would cast it), dgrad / wgrad in FP8.
    return w8a16_train_linear(x, module.weight, module.bias, cache, dtype)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
