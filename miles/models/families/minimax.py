"""MiniMax-M2 / M2.1 (HF `minimax_m2`).

Attention: GQA without bias; QK-norm over the whole q (resp. k) projection, one RMSNorm across
all heads with a [heads * head_dim] weight (`qk_norm_type: full`, the released config's
`qk_norm_type: per_layer`), applied before RoPE; partial rotary: the first `rotary_dim` (64 of
128) dims of each head, rotate-half layout. MoE in every layer: sigmoid router with
e_score_correction_bias for selection, top-8 of 256, weights renormalized, no shared expert.

Checkpoint names follow Mixtral: `block_sparse_moe.gate.weight`,
`block_sparse_moe.e_score_correction_bias` (on the block, not the gate) and per-expert
`block_sparse_moe.experts.<e>.w1|w3|w2.weight` (gate, up, down). Our module is `mlp` with the
bias on its router, so the family renames; a checkpoint in transformers' in-memory layout
(`mlp.experts.gate_up_proj`...) loads too. The released checkpoint's MTP modules (`model.mtp...`,
a layout of their own) are not implemented: skipped on load, and mtp_layers > 0 is refused.
"""

from __future__ import annotations

import re
from typing import Any

from miles.models.families import Family, common_arch_kwargs, common_hf_config, register, rope_type_of
from miles.models.families.moe_io import MIXTRAL_NAMES, fuse_experts, split_experts


def _problems(arch) -> list[str]:
    out = []
    if arch.mtp_layers:
        out.append("family minimax_m2: the checkpoint's MTP modules (model.mtp...) are not implemented "
                   "(they are skipped on load): set mtp_layers: 0")
    if not arch.qk_norm or arch.qk_norm_type != "full" or arch.attention_bias:
        out.append("family minimax_m2 needs qk_norm=true, qk_norm_type=full and attention_bias=false")
    if arch.mla or arch.dsa or arch.linear_attn or arch.llama4:
        out.append("family minimax_m2 is GQA: remove the mla / dsa / linear_attn / llama4 blocks")
    if arch.rope_scaling is not None:
        out.append("family minimax_m2: RoPE scaling is not implemented for it")
    moe = arch.moe
    if moe is None:
        return out + ["family minimax_m2 needs a moe block"]
    if (moe.scoring != "sigmoid" or not moe.score_correction_bias or not moe.norm_topk_prob
            or moe.n_group != 1 or moe.routed_scaling_factor != 1.0):
        out.append("family minimax_m2: moe must be sigmoid + score_correction_bias, norm_topk_prob, "
                   "no groups, routed_scaling_factor 1 (HF MiniMaxM2's router)")
    if (moe.num_shared_experts or moe.shared_expert_intermediate_size or moe.first_k_dense
            or moe.layer_freq != 1 or arch.mlp_only_layers):
        out.append("family minimax_m2: every layer is MoE without shared experts")
    if moe.moe_intermediate_size != arch.intermediate_size:
        out.append("family minimax_m2: intermediate_size is the expert width (set it equal to "
                   "moe.moe_intermediate_size)")
    return out


def _partial_rotary(d: dict[str, Any]) -> float:
    """Released config.json: `rotary_dim`; transformers 5: rope_parameters.partial_rotary_factor."""
    rope = d.get("rope_parameters") or {}
    if d.get("rotary_dim"):
        return d["rotary_dim"] / (d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
    return float(rope.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0)


def _from_hf(d: dict[str, Any]):
    from miles.models.config import ArchConfig, MoEConfig

    if rope_type_of(d) != "default":
        raise ValueError(f"minimax_m2: unsupported RoPE scaling type {rope_type_of(d)!r} (plain RoPE only)")
    if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("shared_intermediate_size"):
        raise ValueError("minimax_m2: only the sigmoid router without shared experts is supported")
    if any(kind != 1 for kind in d.get("attn_type_list") or []):
        raise ValueError("minimax_m2: only full-attention layers (attn_type_list all 1) are supported")
    if d.get("qk_norm_type", "per_layer") != "per_layer" or not d.get("use_qk_norm", True):
        raise ValueError("minimax_m2: only the per_layer (full-width) QK-norm of HF MiniMaxM2 is supported")
    moe = MoEConfig(
        num_experts=d.get("num_local_experts") or d.get("num_experts") or 256,
        num_experts_per_tok=d.get("num_experts_per_tok", 8),
        moe_intermediate_size=d["intermediate_size"],
        scoring="sigmoid", norm_topk_prob=True, score_correction_bias=True,
    )
    return ArchConfig(**common_arch_kwargs(d), qk_norm=True, qk_norm_type="full", attention_bias=False,
                      partial_rotary_factor=_partial_rotary(d), moe=moe)


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    moe = arch.moe
    out = common_hf_config(arch, dtype)
    out["rope_parameters"]["partial_rotary_factor"] = arch.partial_rotary_factor
    out.update(
        intermediate_size=moe.moe_intermediate_size, num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.num_experts_per_tok, rotary_dim=arch.rotary_dim,
        # keys of the released config.json (read by vLLM / SGLang), implied by transformers' class
        use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
        shared_intermediate_size=0, router_jitter_noise=0.0, output_router_logits=False,
    )
    return out


# ours -> HF (disk): the router bias lives on the block in HF, on our router.
_RENAMES = ((r"\.mlp\.gate\.e_score_correction_bias$", ".block_sparse_moe.e_score_correction_bias"),
            (r"\.mlp\.", ".block_sparse_moe."))
_RENAMES_BACK = ((r"\.block_sparse_moe\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
                 (r"\.block_sparse_moe\.", ".mlp."))
_MEMORY_NAMES = re.compile(r"\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight|e_score_correction_bias)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _from_hf_tensors(tensors, arch):
    # transformers' in-memory spelling (`mlp.*`) -> the disk spelling our names map to
    tensors = {_MEMORY_NAMES.sub(r".block_sparse_moe.\1", k): v for k, v in tensors.items()}
    return fuse_experts(tensors, MIXTRAL_NAMES)


def _ignored(name: str, arch) -> bool:
    """MTP modules: `model.mtp...` or layers past the last decoder layer."""
    m = _LAYER.match(name)
    return name.startswith("model.mtp") or (m is not None and int(m.group(1)) >= arch.num_layers)


register(Family(
    "minimax_m2", "MiniMaxM2ForCausalLM", _from_hf, _to_hf, _problems,
    renames=_RENAMES, renames_back=_RENAMES_BACK,
    to_hf_tensors=lambda t, arch: split_experts(t, MIXTRAL_NAMES),
    from_hf_tensors=_from_hf_tensors,
    ignored=_ignored,
    notes="GQA, full-width QK-norm, partial rotary (64 of 128), sigmoid+bias MoE 256 experts top-8",
))
