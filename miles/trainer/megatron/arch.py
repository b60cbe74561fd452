"""The project's `ArchConfig` as Megatron-core arguments: pure functions, no megatron import.

    spec = megatron_spec(arch, bf16=True, recompute=False)
    config = specs.transformer_config(spec.config_class, **spec.transformer, activation_func=F.silu)
    layers = specs.decoder_block_spec(config, te, spec.layer_spec)       # megatron-core's, with the project's swaps
    GPTModel(config, layers, **specs.gpt_model_kwargs(spec.model, te, spec.layer_spec))

Mapped families: qwen3 and qwen2 (dense GQA, RoPE, RMSNorm, SwiGLU; QK-norm or q/k/v bias),
qwen3_moe (softmax top-k router, renormalized or not, dropless experts, dense `mlp_only_layers`),
deepseek_v3 (DeepSeek-V3 / R1, Kimi K2) and glm4_moe_lite (GLM-4.7-Flash): MLA with q LoRA and YaRN
through megatron-core's MLASelfAttention, built without Transformer Engine because the spec's core
attention is the project's (miles/trainer/megatron/core_attention.py); `first_k_dense_replace` dense
layers; the DeepSeek router (sigmoid scores, correction bias, group-limited top-k, routed scaling,
shared experts). deepseek_v32 (DeepSeek-V3.2) and glm_moe_dsa (GLM-5): the same MLA and MoE, with DSA's
lightning indexer and top-k sparse attention in the project's core attention
(miles/trainer/megatron/dsa_attention.py; `layer_spec["dsa"]` carries the ArchConfig to it).
`problems(arch)` names what a config needs that the mapping does not cover yet, so validation refuses
it before any start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAPPED_FAMILIES = ("qwen3", "qwen2", "qwen3_moe", "deepseek_v3", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")


@dataclass
class MegatronSpec:
    transformer: dict[str, Any]  # TransformerConfig keyword arguments (activation_func apart)
    # get_gpt_decoder_block_spec keyword arguments (it reads the layers' kinds from the config), and
    # the project's own: latent_norm_eps (MLA), dsa (the ArchConfig, for DSA's core attention),
    # rope_theta (GQA families: RoPE in the project's core attention; specs.py)
    layer_spec: dict[str, Any]
    model: dict[str, Any]  # GPTModel keyword arguments (config and layer spec apart)
    activation: str = "silu"  # TransformerConfig.activation_func, by name
    moe_layers: list[int] = field(default_factory=list)  # decoder layers whose MLP is routed experts
    config_class: str = "TransformerConfig"  # or "MLATransformerConfig" (megatron.core.transformer)


# transformers builds DeepSeek's q_a_layernorm / kv_a_layernorm with this eps whatever rms_norm_eps
# says (miles/models/mla.py); megatron-core's MLA normalizes the latents with layernorm_epsilon, so the
# spec gives them this one (specs.py, `latent_norm_eps`).
LATENT_NORM_EPS = 1e-6

# Families that are not mapped, and why, where there is more to say than "not yet".
_UNMAPPED_WHY = {
    "qwen3_next": "its gated DeltaNet linear-attention layers and gated attention are not mapped",
}


def _mla_problems(arch) -> list[str]:
    m, rs, out = arch.mla, arch.rope_scaling, []
    if not m.rope_interleave:
        out.append("trainer=megatron: megatron-core's MLA rotates adjacent rope pairs only (mla.rope_interleave=true)")
    if arch.attention_bias:
        out.append("trainer=megatron: MLA projections with biases are not mapped")
    if arch.mtp_layers:
        out.append("trainer=megatron: multi-token-prediction layers are not mapped yet: set model.mtp_layers=0 "
                   "(the checkpoint's MTP layers are then skipped on load)")
    if rs is not None and (rs.type != "yarn" or not rs.truncate or rs.attention_factor
                           or (rs.mscale_all_dim and not rs.mscale)):
        # megatron-core's YaRN: whole-dim correction range, attention factor
        # mscale(f, mscale) / mscale(f, mscale_all_dim)
        out.append("trainer=megatron: MLA maps YaRN with truncate=true, no attention_factor, and mscale set "
                   "wherever mscale_all_dim is")
    return out


def _dsa_problems(arch) -> list[str]:
    if not arch.mla.q_lora_rank:
        return ["trainer=megatron: DSA's indexer reads the q latent (mla.q_lora_rank > 0)"]
    return []


def problems(arch) -> list[str]:
    """What keeps `arch` from training through Megatron-core here, one message per problem."""
    if arch.family not in MAPPED_FAMILIES:
        why = f" ({_UNMAPPED_WHY[arch.family]})" if arch.family in _UNMAPPED_WHY else ""
        return [f"trainer=megatron maps the {', '.join(MAPPED_FAMILIES)} families; {arch.family} "
                f"is not mapped yet{why}: use trainer=torch"]
    out = []
    if arch.mla is not None:
        out += _mla_problems(arch)
        if arch.dsa is not None:
            out += _dsa_problems(arch)
    elif arch.rope_scaling is not None or arch.partial_rotary_factor != 1.0:
        out.append("trainer=megatron: RoPE scaling and partial rotary are not mapped yet (MLA's YaRN apart)")
    if arch.qk_norm and arch.qk_norm_type != "head":
        out.append(f"trainer=megatron: qk_norm_type={arch.qk_norm_type} is not mapped (per-head only)")
    moe = arch.moe
    if moe is not None and any(moe_layer_pattern(arch)):
        if moe.scoring == "softmax" and (moe.score_correction_bias or moe.n_group > 1):
            out.append("trainer=megatron: a softmax router with a correction bias or expert groups is not mapped")
        if moe.scoring == "sigmoid" and not moe.norm_topk_prob and moe.num_experts_per_tok > 1:
            out.append("trainer=megatron: megatron-core renormalizes sigmoid top-k weights (norm_topk_prob=false "
                       "is not mapped)")
        if moe.scoring not in ("softmax", "sigmoid"):
            out.append(f"trainer=megatron: router scoring={moe.scoring} is not mapped")
        if moe.shared_expert_gate:
            out.append("trainer=megatron: gated shared experts (Qwen2-MoE / Qwen3-Next) are not mapped yet")
    return out


def moe_layer_pattern(arch) -> list[int]:
    """1 for each decoder layer whose MLP is routed experts, 0 for a dense one."""
    if arch.moe is None:
        return [0] * arch.num_layers
    return [int(arch.moe.is_moe_layer(i) and i not in arch.mlp_only_layers) for i in range(arch.num_layers)]


def megatron_spec(arch, bf16: bool, recompute: bool = False, tp: int = 1, ep: int = 1) -> MegatronSpec:
    """The Megatron-core arguments that build `arch` (see the module docstring). `bf16`: parameters
    and compute in bf16 (the optimizer keeps fp32 main parameters), else fp32 throughout."""
    bad = problems(arch)
    if bad:
        raise ValueError("; ".join(bad))
    dtype_flags = {"bf16": bf16, "params_dtype": "bfloat16" if bf16 else "float32"}
    transformer: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=arch.qk_norm,
        add_bias_linear=False,  # no family here has o_proj / MLP biases
        add_qkv_bias=arch.attention_bias,
        gated_linear_unit=True,  # SwiGLU: linear_fc1 = [gate; up]
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        init_method_std=0.02,
        # Fusions that need Apex or Transformer Engine kernels stay off: the local spec runs on
        # plain torch, and the TE spec brings its own fused modules. (The SwiGLU fusion is
        # torch.compile'd: the trainer turns it on on CUDA.)
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # The losses are sums over the step's tokens divided by its normalizer (miles.algo), so the
        # data-parallel ranks' gradients add up rather than average.
        calculate_per_token_loss=True,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        **dtype_flags,
    )
    if recompute:
        transformer.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    pattern = moe_layer_pattern(arch)
    if any(pattern):
        transformer.update(_moe(arch.moe), moe_layer_freq=pattern)
    layer_spec: dict[str, Any] = dict(normalization="RMSNorm")
    if arch.mla is None:
        layer_spec["rope_theta"] = arch.rope_theta  # the project's core attention rotates (specs.py)
    else:
        transformer.update(_mla(arch))
        layer_spec["latent_norm_eps"] = LATENT_NORM_EPS
        if arch.dsa is not None:
            layer_spec["dsa"] = arch
    model = dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rotary_percent=1.0,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        parallel_output=True,
    )
    return MegatronSpec(transformer, layer_spec, model, "silu", [i for i, m in enumerate(pattern) if m],
                        "MLATransformerConfig" if arch.mla is not None else "TransformerConfig")


def _moe(moe) -> dict[str, Any]:
    """The routed (and shared) experts' TransformerConfig fields."""
    out = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.num_experts_per_tok,
        moe_ffn_hidden_size=moe.moe_intermediate_size,
        moe_router_score_function=moe.scoring,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",  # the project's losses have no auxiliary term
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,  # one linear pair per expert: the local spec's SequentialMLP
        moe_permute_fusion=False,
    )
    if moe.scoring == "softmax":
        # softmax over the top-k logits equals the top-k of the full softmax renormalized
        # (norm_topk_prob); without renormalization the softmax comes first.
        out["moe_router_pre_softmax"] = not moe.norm_topk_prob
    if moe.score_correction_bias:
        # The bias steers selection only and stays what the checkpoint says: the native trainer
        # does not train it, so Megatron's aux-loss-free update (finalize_model_grads) is off.
        out.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if moe.n_group > 1:
        # read by the project's router (miles/trainer/megatron/router.py), which ranks groups by
        # their two best experts as DeepSeek-V3 does, where megatron-core's own takes topk / group_topk
        out.update(moe_router_num_groups=moe.n_group, moe_router_group_topk=moe.topk_group)
    if moe.routed_scaling_factor != 1.0:
        out["moe_router_topk_scaling_factor"] = moe.routed_scaling_factor
    shared = moe.shared_expert_intermediate_size or moe.moe_intermediate_size * moe.num_shared_experts
    if shared:
        out["moe_shared_expert_intermediate_size"] = shared
    return out


def _mla(arch) -> dict[str, Any]:
    """MLATransformerConfig's fields: the latent ranks, the head dims, RoPE (YaRN) on the rope dims."""
    m, rs = arch.mla, arch.rope_scaling
    out: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank or None,  # None: one q_proj (linear_q_proj)
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        qk_layernorm=True,  # MLA's q / kv latent norms (q_a_layernorm, kv_a_layernorm)
        rotary_base=arch.rope_theta,
        rope_type="rope" if rs is None else "yarn",
    )
    if rs is not None:
        # the attention factor is mscale(f, mscale) / mscale(f, mscale_all_dim) in both; where the
        # native has neither it is mscale(f, 1): mscale 1 over mscale_all_dim 0 (mscale(f, 0) = 1)
        both = bool(rs.mscale and rs.mscale_all_dim)
        out.update(rotary_scaling_factor=rs.factor,
                   original_max_position_embeddings=rs.original_max_position_embeddings,
                   beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, mscale=rs.mscale if both else 1.0,
                   mscale_all_dim=rs.mscale_all_dim if both else 0.0)
    return out
