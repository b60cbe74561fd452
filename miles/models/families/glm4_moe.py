"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 / GLM-4.7 (HF `glm4_moe`).

Attention: GQA with q/k/v bias, optional per-head QK-norm (`use_qk_norm`: on in GLM-4.5 / 4.6 /
4.7, off in Air) and partial rotary: RoPE on the first half of each head (partial_rotary_factor
0.5) in HF's rotate-half layout (dim j pairs with j + rotary_dim / 2), the rest passes through.
MoE: sigmoid router with e_score_correction_bias (selection only), group-limited top-k,
routed_scaling_factor, one shared expert (`mlp.shared_experts`); the first `first_k_dense_replace`
layers are dense. The released checkpoints also hold `num_nextn_predict_layers` MTP layers as
`model.layers.<L>...` (L >= num_hidden_layers) in DeepSeek's layout (mtp_io.py); GLM-4.5's carry
embedding / head copies, GLM-4.6's not: both load, and we save GLM-4.5's. Tensor names equal
HF's minus "model."; experts are one tensor per expert on disk.
"""

from __future__ import annotations

from typing import Any

from miles.models.families import Family, common_arch_kwargs, common_hf_config, register, rope_type_of
from miles.models.families.deepseek import from_checkpoint, to_checkpoint
from miles.models.families.mtp_io import ignored_layers


def _problems(arch) -> list[str]:
    out = []
    if not arch.attention_bias or arch.qk_norm_type != "head":
        out.append("family glm4_moe needs attention_bias=true and qk_norm_type=head (HF Glm4Moe attention)")
    if arch.mla or arch.dsa or arch.linear_attn or arch.llama4:
        out.append("family glm4_moe is GQA: remove the mla / dsa / linear_attn / llama4 blocks")
    if arch.rope_scaling is not None:
        out.append("family glm4_moe: RoPE scaling is not implemented for it")
    if arch.mlp_only_layers:
        out.append("family glm4_moe: use moe.first_k_dense instead of mlp_only_layers")
    moe = arch.moe
    if moe is None:
        return out + ["family glm4_moe needs a moe block"]
    if moe.scoring != "sigmoid" or not moe.score_correction_bias:
        out.append("family glm4_moe: moe.scoring must be sigmoid with score_correction_bias=true")
    if moe.num_shared_experts < 1 or moe.shared_expert_intermediate_size or moe.shared_expert_gate:
        out.append("family glm4_moe: HF Glm4Moe always has ungated shared experts of width "
                   "moe_intermediate_size * num_shared_experts (num_shared_experts >= 1, "
                   "shared_expert_intermediate_size 0, shared_expert_gate false)")
    if moe.layer_freq != 1:
        out.append("family glm4_moe: every layer past first_k_dense is MoE (layer_freq 1)")
    if moe.num_experts % moe.n_group:
        out.append(f"moe.num_experts ({moe.num_experts}) must be a multiple of moe.n_group ({moe.n_group})")
    return out


def _partial_rotary(d: dict[str, Any]) -> float:
    """Top level in released config.json files, inside rope_parameters in transformers 5's."""
    rope = d.get("rope_parameters") or {}
    return float(d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5)


def _from_hf(d: dict[str, Any]):
    from miles.models.config import ArchConfig, MoEConfig

    if rope_type_of(d) != "default":
        raise ValueError(f"glm4_moe: unsupported RoPE scaling type {rope_type_of(d)!r} (plain RoPE only)")
    moe = MoEConfig(
        num_experts=d.get("n_routed_experts") or d.get("num_local_experts") or 128,
        num_experts_per_tok=d.get("num_experts_per_tok", 8),
        moe_intermediate_size=d.get("moe_intermediate_size", 1408),
        scoring="sigmoid",
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        score_correction_bias=True,
        n_group=d.get("n_group") or 1,
        topk_group=d.get("topk_group") or 1,
        num_shared_experts=d.get("n_shared_experts", 1),
        first_k_dense=d.get("first_k_dense_replace", 1),
    )
    return ArchConfig(**common_arch_kwargs(d), qk_norm=bool(d.get("use_qk_norm", False)),
                      attention_bias=bool(d.get("attention_bias", False)),
                      partial_rotary_factor=_partial_rotary(d), moe=moe,
                      mtp_layers=int(d.get("num_nextn_predict_layers") or 0))


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    moe = arch.moe
    out = common_hf_config(arch, dtype)
    out["rope_parameters"]["partial_rotary_factor"] = arch.partial_rotary_factor
    out.update(
        partial_rotary_factor=arch.partial_rotary_factor, attention_bias=arch.attention_bias,
        use_qk_norm=arch.qk_norm, n_routed_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
        moe_intermediate_size=moe.moe_intermediate_size, norm_topk_prob=moe.norm_topk_prob,
        routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_group, topk_group=moe.topk_group,
        n_shared_experts=moe.num_shared_experts, first_k_dense_replace=moe.first_k_dense,
        num_nextn_predict_layers=arch.mtp_layers,
    )
    return out


register(Family(
    "glm4_moe", "Glm4MoeForCausalLM", _from_hf, _to_hf, _problems,
    to_hf_tensors=to_checkpoint, from_hf_tensors=from_checkpoint, ignored=ignored_layers,
    notes="GQA + q/k/v bias, partial rotary 0.5, optional QK-norm, sigmoid+bias MoE with shared expert, "
          "first dense layers, routed scaling, MTP layers",
))
