"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (GQA, QK-norm, no bias) with a
softmax top-k router over routed experts, no shared expert.

Layers are MoE unless listed in `mlp_only_layers` or skipped by `decoder_sparse_step` (both
unused by the released models). Tensor names equal HF's minus "model."; routed experts are fused
in memory and one tensor per expert on disk (see moe_io.py).
"""

from __future__ import annotations

from typing import Any

from miles.models.families import Family, common_arch_kwargs, common_hf_config, register, rope_type_of
from miles.models.families.moe_io import fuse_experts, split_experts


def _problems(arch) -> list[str]:
    out = []
    if arch.mtp_layers:
        out.append("family qwen3_moe has no MTP modules (its checkpoints carry none): set mtp_layers: 0")
    if not arch.qk_norm or arch.attention_bias:
        out.append("family qwen3_moe needs qk_norm=true and attention_bias=false (Qwen3 attention)")
    if arch.mla or arch.dsa or arch.linear_attn or arch.llama4:
        out.append("family qwen3_moe is GQA: remove the mla / dsa / linear_attn / llama4 blocks")
    if arch.rope_scaling is not None or arch.partial_rotary_factor != 1.0:
        out.append("family qwen3_moe: RoPE scaling and partial rotary are not implemented for it")
    moe = arch.moe
    if moe is None:
        return out + ["family qwen3_moe needs a moe block"]
    if (moe.scoring != "softmax" or moe.score_correction_bias or moe.n_group != 1 or moe.num_shared_experts
            or moe.shared_expert_intermediate_size or moe.shared_expert_gate or moe.first_k_dense
            or moe.routed_scaling_factor != 1.0):
        out.append("family qwen3_moe: moe must be a plain softmax top-k router (no bias, groups, shared "
                   "experts, first_k_dense or routed_scaling_factor); HF Qwen3-MoE has none of them")
    return out


def _from_hf(d: dict[str, Any]):
    from miles.models.config import ArchConfig, MoEConfig

    if d.get("use_sliding_window"):
        raise ValueError("qwen3_moe: sliding-window attention is not supported")
    if rope_type_of(d) != "default":
        raise ValueError(f"qwen3_moe: unsupported RoPE scaling type {rope_type_of(d)!r} (plain RoPE only)")
    moe = MoEConfig(
        # transformers 5 writes num_local_experts, released config.json files num_experts
        num_experts=d.get("num_experts") or d.get("num_local_experts") or 128,
        num_experts_per_tok=d.get("num_experts_per_tok", 8),
        moe_intermediate_size=d.get("moe_intermediate_size", 768),
        scoring="softmax",
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),  # transformers' default
        layer_freq=d.get("decoder_sparse_step", 1),
    )
    return ArchConfig(**common_arch_kwargs(d), qk_norm=True, attention_bias=bool(d.get("attention_bias", False)),
                      moe=moe, mlp_only_layers=list(d.get("mlp_only_layers") or []))


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    moe = arch.moe
    out = common_hf_config(arch, dtype)
    out.update(
        attention_bias=arch.attention_bias, use_sliding_window=False, sliding_window=None,
        num_experts=moe.num_experts, num_local_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
        moe_intermediate_size=moe.moe_intermediate_size, norm_topk_prob=moe.norm_topk_prob,
        decoder_sparse_step=moe.layer_freq, mlp_only_layers=list(arch.mlp_only_layers),
        output_router_logits=False, router_aux_loss_coef=0.001,
    )
    return out


register(Family(
    "qwen3_moe", "Qwen3MoeForCausalLM", _from_hf, _to_hf, _problems,
    to_hf_tensors=lambda t, arch: split_experts(t),
    from_hf_tensors=lambda t, arch: fuse_experts(t),
    notes="GQA, QK-norm, softmax top-k MoE (128 experts, top-8)",
))
