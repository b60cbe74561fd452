"""Parameters of the LoRA adapters a run trains (trainer.lora), and the bytes of a QLoRA run's
quantized frozen base, for the memory planner: counted on a meta-device model, so full-size configs
cost no memory."""

from __future__ import annotations

import math

import torch

from miles.config.schema import PrecisionCfg, Quant
from miles.models.config import ArchConfig
from miles.precision.fp8 import BLOCK

# Memoized (ArchConfig is not hashable: keyed by its repr): the planner asks for every layout it tries.
_CACHE: dict[tuple, int] = {}
_BASE_CACHE: dict[tuple, tuple[int, int, int, int]] = {}


def lora_params(arch: ArchConfig, rank: int, target_modules, adapters: int = 1) -> int:
    """rank x (in + out) summed over the decoder projections `target_modules` selects (times E for
    stacked experts), for each of `adapters` adapters (trainer.lora.adapters; 0 or 1: the run's one)."""
    if rank <= 0:
        return 0
    return max(1, adapters) * _one_adapter(arch, rank, target_modules)


def _one_adapter(arch: ArchConfig, rank: int, target_modules) -> int:
    key = (repr(arch), rank, tuple(target_modules))
    if key not in _CACHE:
        from miles.models import CausalLM
        from miles.models.lora import adapter_shapes

        with torch.device("meta"):
            model = CausalLM(arch)
        _CACHE[key] = sum(math.prod(a) + math.prod(b) for a, b in adapter_shapes(model, rank, key[2]).values())
    return _CACHE[key]


def quantized_base(arch: ArchConfig, precision: PrecisionCfg) -> tuple[int, int]:
    """QLoRA (precision.train_quant fp8 / int4): (weights of the projections and stacked MoE experts the
    trainer holds in the rollout format, their bytes there), as miles/precision/qlora.py and
    miles/models/frozen_experts.py hold them: FP8
    one byte per weight + an fp32 scale per 128x128 block, INT4 two weights per byte + an fp32 scale
    per group of the last dim (a projection's input; Llama 4's transposed experts: their output)."""
    return _base_counts(arch, precision)[:2]


def megatron_fp8_dense(arch: ArchConfig, precision: PrecisionCfg) -> tuple[int, int]:
    """(weights, their FP8 bytes) of the projections counted by quantized_base that trainer=megatron's
    QLoRA holds dense under fp8 (miles/trainer/megatron/held_base.py): the parts of a fused weight
    whose 128 x 128 blocks mix native blocks. q/k/v (fused per query group) where head_dim is not a
    multiple of 128; gate/up where their width is not."""
    return _base_counts(arch, precision)[2:]


def _base_counts(arch: ArchConfig, precision: PrecisionCfg) -> tuple[int, int, int, int]:
    """quantized_base's two counts, then megatron_fp8_dense's, from one meta model (cached: the planner
    asks for every layout it tries)."""
    key = (repr(arch), precision.train_quant, precision.int4_group_size, tuple(precision.keep_high_precision),
           precision.keep_first_layers, precision.keep_last_layers)
    if key not in _BASE_CACHE:
        from miles.models import CausalLM
        from miles.models.frozen_experts import STACKED, quantized_stacks
        from miles.precision.recipe import Recipe

        with torch.device("meta"):
            model = CausalLM(arch)
        recipe = Recipe.from_cfg(precision, arch.num_layers)
        linears = recipe.quantized_linears(model)
        shapes = [(1, *linear.weight.shape) for _, _, linear in linears]
        # Stacked experts (either layout), as miles/models/frozen_experts.py holds them: each expert as a
        # projection over the stack's own last two dims (Llama 4's [E, in, out] too: the engine's payload).
        shapes += [m.stacked_shape(t) for _, m in quantized_stacks(model, recipe) for t in STACKED]
        mixed = [(1, *linear.weight.shape) for _, name, linear in linears
                 if (name in ("q_proj", "k_proj", "v_proj") and arch.mla is None and arch.head_dim % BLOCK)
                 or (name in ("gate_proj", "up_proj") and linear.weight.shape[0] % BLOCK)]
        _BASE_CACHE[key] = (*_count(shapes, precision), *_count(mixed, precision))
    return _BASE_CACHE[key]


def _count(shapes: list[tuple[int, int, int]], precision: PrecisionCfg) -> tuple[int, int]:
    """(weights, held bytes) of [E, N, K] stacks of projections."""
    return sum(e * n * k for e, n, k in shapes), sum(e * _held_bytes(n, k, precision) for e, n, k in shapes)


def _held_bytes(n: int, k: int, precision: PrecisionCfg) -> int:
    if precision.train_quant == Quant.fp8:
        return n * k + 4 * _ceil_div(n, BLOCK) * _ceil_div(k, BLOCK)
    return n * _ceil_div(k, 2) + 4 * n * _ceil_div(k, precision.int4_group_size)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
