"""The project's `ArchConfig` as Megatron-core arguments: pure functions, no megatron import.

    spec = megatron_spec(arch, bf16=True, recompute=False)
    TransformerConfig(**spec.transformer, activation_func=F.silu)      # ACTIVATIONS[spec.activation]
    get_gpt_decoder_block_spec(config, use_transformer_engine=te, **spec.layer_spec)
    GPTModel(config, layer_spec, **spec.model)

Mapped families: qwen3 and qwen2 (dense GQA, RoPE, RMSNorm, SwiGLU; QK-norm or q/k/v bias) and
qwen3_moe (softmax top-k router, renormalized or not, dropless experts, dense `mlp_only_layers`).
`problems(arch)` names what a config needs that the mapping does not cover yet, so validation refuses
it before any start. DeepSeek-V3 (MLA, sigmoid router with bias, shared experts) is among them: the
MLA attention of megatron-core 0.19.2 exists only in its Transformer Engine spec, and TE cannot be
installed on the GPU machine this was built on, so a mapping could not be run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAPPED_FAMILIES = ("qwen3", "qwen2", "qwen3_moe")


@dataclass
class MegatronSpec:
    transformer: dict[str, Any]  # TransformerConfig keyword arguments (activation_func apart)
    layer_spec: dict[str, Any]  # get_gpt_decoder_block_spec keyword arguments (it reads the layers' kinds from the config)
    model: dict[str, Any]  # GPTModel keyword arguments (config and layer spec apart)
    activation: str = "silu"  # TransformerConfig.activation_func, by name
    moe_layers: list[int] = field(default_factory=list)  # decoder layers whose MLP is routed experts


def problems(arch) -> list[str]:
    """What keeps `arch` from training through Megatron-core here, one message per problem."""
    if arch.family not in MAPPED_FAMILIES:
        # MLA (DeepSeek-V3, Kimi K2, GLM-4.7-Flash / GLM-5): megatron-core 0.19.2 builds its attention
        # from Transformer Engine only; the local spec's DotProductAttention takes no k_channels.
        why = " (its MLA needs Transformer Engine in megatron-core)" if arch.mla is not None else ""
        return [f"trainer=megatron maps the {', '.join(MAPPED_FAMILIES)} families; {arch.family} "
                f"is not mapped yet{why}: use trainer=torch"]
    out = []
    if arch.rope_scaling is not None or arch.partial_rotary_factor != 1.0:
        out.append("trainer=megatron: RoPE scaling and partial rotary are not mapped yet")
    if arch.qk_norm and arch.qk_norm_type != "head":
        out.append(f"trainer=megatron: qk_norm_type={arch.qk_norm_type} is not mapped (per-head only)")
    moe = arch.moe
    if moe is not None:
        if moe.scoring != "softmax" or moe.score_correction_bias or moe.n_group > 1:
            out.append("trainer=megatron maps the softmax top-k router only (no sigmoid, bias or groups)")
        if moe.num_shared_experts or moe.shared_expert_gate or moe.routed_scaling_factor != 1.0:
            out.append("trainer=megatron: shared experts and routed scaling are not mapped yet")
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
        # plain torch, and the TE spec brings its own fused modules.
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
    if arch.moe is not None:
        transformer.update(
            num_moe_experts=arch.moe.num_experts,
            moe_router_topk=arch.moe.num_experts_per_tok,
            moe_ffn_hidden_size=arch.moe.moe_intermediate_size,
            moe_layer_freq=pattern,
            # softmax over the top-k logits equals the top-k of the full softmax renormalized
            # (norm_topk_prob); without renormalization the softmax comes first.
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not arch.moe.norm_topk_prob,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",  # the project's losses have no auxiliary term
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,  # one linear pair per expert: the local spec's SequentialMLP
            moe_permute_fusion=False,
        )
    layer_spec = dict(normalization="RMSNorm")
    model = dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rotary_percent=1.0,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        parallel_output=True,
    )
    return MegatronSpec(transformer, layer_spec, model, "silu", [i for i, m in enumerate(pattern) if m])
