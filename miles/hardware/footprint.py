"""What a model costs in memory, independent of how it is laid out: parameter groups and the
bytes per parameter or per token of each precision recipe.

Parameters are counted on the meta device from the real modules (`miles.models`), split into
  embed   embed_tokens + lm_head (held by the first / last pipeline stage),
  routed  routed experts (sharded by expert parallelism),
  dense   everything else (sharded by tensor x pipeline parallelism),
and, for the rollout side, into quantizable (>= 2-D weights of the decoder layers, minus the
recipe's exceptions) and kept (the rest, in the rollout dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.config.schema import DType, PrecisionCfg, Quant
from miles.models import ArchConfig

DTYPE_BYTES = {DType.fp32: 4, DType.bf16: 2}
ACT_BYTES_PER_HIDDEN = 34  # activations per token and layer, bf16, sequence parallel, flash attention
FP8_BLOCK = 128  # 128x128 weight blocks, one fp32 scale each
KV_BYTES = 2  # rollout KV cache in bf16 (fp32 on the CPU recipe: see kv_bytes_per_token)


@dataclass(frozen=True)
class ParamGroups:
    total: int
    active: int
    embed: int
    routed: int
    dense: int
    quantizable: int  # rollout weights the recipe quantizes
    kept: int  # rollout weights kept in the rollout dtype

    @property
    def layers(self) -> int:
        return self.dense + self.routed


_GROUPS_CACHE: dict[tuple, ParamGroups] = {}


def param_groups(arch: ArchConfig, precision: PrecisionCfg) -> ParamGroups:
    """Memoized: the planner asks again for every layout and node count it tries, and the config
    tests plan every model x precision x hardware combination."""
    key = (repr(arch), tuple(precision.keep_high_precision), precision.keep_first_layers, precision.keep_last_layers)
    if key not in _GROUPS_CACHE:
        _GROUPS_CACHE[key] = _count_groups(arch, precision)
    return _GROUPS_CACHE[key]


def _count_groups(arch: ArchConfig, precision: PrecisionCfg) -> ParamGroups:
    from miles.models import CausalLM, param_count

    with torch.device("meta"):
        model = CausalLM(arch)
    total, active = param_count(arch)
    from miles.precision.rollout_format import high_precision_predicate

    keep = high_precision_predicate(precision.keep_high_precision, precision.keep_first_layers,
                                    precision.keep_last_layers, arch.num_layers)
    embed = routed = quantizable = held = 0
    # MTP modules (model.mtp_layers) take memory on both sides like any layer: the published totals
    # (`total`) leave them out, the groups count them.
    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens.", "lm_head.")):
            embed += p.numel()
        elif ".experts." in name:
            routed += p.numel()
        if p.ndim >= 2 and not keep(name):  # the rule weight sync applies (miles.precision.rollout_format)
            quantizable += p.numel()
        held += p.numel()
    return ParamGroups(total, active, embed, routed, held - embed - routed, quantizable, held - quantizable)


def rollout_weight_bytes(groups: ParamGroups, precision: PrecisionCfg) -> float:
    """Bytes of the weights one rollout engine holds (all of them, before sharding)."""
    kept = groups.kept * DTYPE_BYTES[precision.rollout_dtype]
    q = groups.quantizable
    if precision.rollout_quant == Quant.fp8:
        return kept + q * (1 + 4 / FP8_BLOCK**2)  # e4m3 byte + an fp32 scale per block
    if precision.rollout_quant == Quant.int4:
        return kept + q * (0.5 + 4 / precision.int4_group_size)  # a nibble + an fp32 scale per group (miles.precision.int4)
    return kept + q * DTYPE_BYTES[precision.rollout_dtype]


def dense_copy_bytes(groups: ParamGroups, precision: PrecisionCfg) -> float:
    """Bytes of a weight-only engine's dense copies (rollout.dense_weight_copies): every quantized
    Linear's weight in rollout_dtype once more; the routed experts' stacks keep none."""
    return max(0, groups.quantizable - groups.routed) * DTYPE_BYTES[precision.rollout_dtype]


def kv_bytes_per_token(arch: ArchConfig, dtype_bytes: int = KV_BYTES) -> int:
    """Decode-cache bytes one token adds across all layers. GQA: K and V per kv head; MLA: the
    compressed latent + the shared RoPE key (+ the DSA indexer key); linear-attention layers keep a
    fixed-size state instead (see state_bytes_per_sequence)."""
    per_layer = []
    for layer in range(arch.num_layers):
        if arch.linear_attn is not None and arch.linear_attn.is_linear_layer(layer):
            continue
        if arch.mla is not None:
            width = arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim
            if arch.dsa is not None:
                width += arch.dsa.index_head_dim
        else:
            width = 2 * arch.num_kv_heads * arch.head_dim
        per_layer.append(width)
    return sum(per_layer) * dtype_bytes


def state_bytes_per_sequence(arch: ArchConfig) -> int:
    """Fixed decode state of the linear-attention layers (fp32 recurrent state + conv window)."""
    la = arch.linear_attn
    if la is None:
        return 0
    layers = sum(la.is_linear_layer(i) for i in range(arch.num_layers))
    recurrent = la.num_value_heads * la.key_head_dim * la.value_head_dim * 4
    conv = (2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim) * la.conv_kernel_size * 2
    return layers * (recurrent + conv)


def train_bytes_per_param(precision: PrecisionCfg) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per trained parameter. Gradients accumulate in fp32;
    AdamW keeps two fp32 moments plus an fp32 master copy when the compute weights are not fp32."""
    weights = DTYPE_BYTES[precision.train_dtype]
    master = 0 if precision.train_dtype == DType.fp32 else 4
    return weights, 4, 8 + master
