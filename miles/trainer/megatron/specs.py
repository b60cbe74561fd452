"""The GPTModel decoder block spec for an architecture: which modules megatron-core builds per layer.

Without Transformer Engine the spec is megatron-core's local one with the core attention swapped for
the project's (miles/trainer/megatron/core_attention.py: PyTorch SDPA instead of the local
DotProductAttention's materialised [heads, L, L] scores; it takes MLA's k / v head dims too). With
expert groups (DeepSeek-V3) the MoE layers' router is the project's, with either spec
(miles/trainer/megatron/router.py: DeepSeek's group ranking, which megatron-core's differs from).
MLA's latent norms take `latent_norm_eps` (a `layer_spec` key of the project's): megatron-core builds
them with the decoder's layernorm_epsilon, and GLM-4.7-Flash's checkpoints differ there (1e-6 / 1e-5).
DSA (`dsa`, the project's key holding the ArchConfig: DeepSeek-V3.2, GLM-5): the core attention is the
project's DSACoreAttention (miles/trainer/megatron/dsa_attention.py: the native lightning indexer and
the sparse attention), one DSASelection shared by the model's layers; local spec only.
GQA families (`rope_theta`, local spec): the core attention applies RoPE itself and GPTModel is built
without its own (`gpt_model_kwargs`). megatron-core's RoPE on packed (THD) sequences splits the pack
by a host copy of cu_seqlens and rotates one sequence at a time, in every layer; the core attention
derives each token's position from cu_seqlens on the device and rotates the pack at once.
RMSNorm (local spec: every decoder, QK, MLA latent and final norm): the project's `SpecRMSNorm`, the
native model's RMSNorm (miles/models/layers.py) behind megatron-core's norm interface, so on CUDA it
runs the compiled kernel with its written-out backward (miles/models/fused.py), as the native
trainer's does. The local spec's `WrappedTorchNorm` is `torch.nn.RMSNorm`, which runs eager there:
its pow, mean, rsqrt, multiplies and fp32 casts each a kernel, the largest share of Megatron's step after the GEMMs and
attention on an H100 (docs/benchmarks.md, "Where Megatron's step goes").
"""

from __future__ import annotations

import functools
from dataclasses import replace

from miles.models.layers import RMSNorm


class SpecRMSNorm(RMSNorm):
    """The project's RMSNorm built as megatron-core builds a norm: `(config=, hidden_size=, eps=)`.
    Its parameter is `weight`, as torch.nn.RMSNorm's: the weight maps and checkpoints do not change."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps)


_NORMS = {"layer": ("input_layernorm", "pre_mlp_layernorm"), "attention": ("q_layernorm", "k_layernorm", "kv_layernorm")}


def _project_norm(spec):
    """SpecRMSNorm where `spec` is the local spec's WrappedTorchNorm (identity and other norms kept)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return SpecRMSNorm if spec is WrappedTorchNorm else spec


def _with_project_norms(layer):
    """A copy of a TransformerLayer spec whose RMSNorms are SpecRMSNorm."""
    attention = layer.submodules.self_attention
    attention_subs = {n: _project_norm(getattr(attention.submodules, n)) for n in _NORMS["attention"]
                      if hasattr(attention.submodules, n)}
    attention = replace(attention, submodules=replace(attention.submodules, **attention_subs))
    layer_subs = {n: _project_norm(getattr(layer.submodules, n)) for n in _NORMS["layer"]}
    return replace(layer, submodules=replace(layer.submodules, self_attention=attention, **layer_subs))


def _with_core_attention(layer, core_attention):
    """A copy of a TransformerLayer spec whose self-attention builds `core_attention`."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    attention = layer.submodules.self_attention
    if attention.submodules.core_attention is not DotProductAttention:
        raise ValueError(f"the local spec's core attention is {attention.submodules.core_attention}, "
                         "not the DotProductAttention this swap replaces")
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=core_attention))
    return replace(layer, submodules=replace(layer.submodules, self_attention=attention))


def _with_latent_norm_eps(layer, latent_eps: float):
    """A copy of an MLA layer spec whose q / kv latent norms use `latent_eps`, whatever eps MLA passes them."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def norm(hidden_size, config, eps=None):  # MLASelfAttention passes the decoder's eps: not this one
        if config.normalization == "RMSNorm":
            return SpecRMSNorm(config=config, hidden_size=hidden_size, eps=latent_eps)
        return WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=latent_eps)

    attention = layer.submodules.self_attention
    attention = replace(attention, submodules=replace(attention.submodules, q_layernorm=norm, kv_layernorm=norm))
    return replace(layer, submodules=replace(layer.submodules, self_attention=attention))


def _with_router(layer, router):
    """A copy of a TransformerLayer spec whose MoE layer builds `router` (a dense layer as it is)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = layer.submodules.mlp
    if not (isinstance(mlp, functools.partial) and isinstance(mlp.func, type) and issubclass(mlp.func, MoELayer)):
        return layer
    mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords,
                                                    "submodules": replace(mlp.keywords["submodules"], router=router)})
    return replace(layer, submodules=replace(layer.submodules, mlp=mlp))


def decoder_block_spec(config, te: bool, layer_spec: dict):
    """megatron-core's GPT decoder block spec for `config` (a TransformerConfig, or an
    MLATransformerConfig): Transformer Engine's modules when `te`, else the local (plain torch) ones
    with the project's core attention; `layer_spec` from miles.trainer.megatron.arch."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    layer_spec = dict(layer_spec)
    latent_eps = layer_spec.pop("latent_norm_eps", None)
    dsa_arch = layer_spec.pop("dsa", None)
    rope_theta = layer_spec.pop("rope_theta", None)
    if dsa_arch is not None and te:  # TE's MLA spec fuses q_layernorm into linear_q_up_proj: no q latent to read
        raise ValueError("DSA's indexer reads the normalized q latent, which Transformer Engine's MLA spec fuses "
                         "into linear_q_up_proj: DSA families need the local spec (no Transformer Engine)")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, **layer_spec)
    swaps = []
    if dsa_arch is not None:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from miles.trainer.megatron.dsa_attention import DSACoreAttention, DSASelection

        # one DSASelection per model: its layers share selections (GLM's IndexShare) and the R3 replay
        core = ModuleSpec(module=DSACoreAttention, params={"arch": dsa_arch, "selection": DSASelection()})
        swaps.append(functools.partial(_with_core_attention, core_attention=core))
    elif not te:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from miles.trainer.megatron.core_attention import SDPACoreAttention

        core = ModuleSpec(module=SDPACoreAttention, params={"rope_theta": rope_theta})
        swaps.append(functools.partial(_with_core_attention, core_attention=core))
    if latent_eps is not None and latent_eps != config.layernorm_epsilon:
        if te:  # TE's MLA spec fuses the latent norms into the up projections, with layernorm_epsilon
            raise ValueError(f"MLA latent norms with eps {latent_eps} != layernorm_epsilon "
                             f"{config.layernorm_epsilon} need the local spec (no Transformer Engine)")
        swaps.append(functools.partial(_with_latent_norm_eps, latent_eps=latent_eps))
    if (config.moe_router_num_groups or 1) > 1:
        from miles.trainer.megatron.router import GroupLimitedRouter

        swaps.append(functools.partial(_with_router, router=GroupLimitedRouter))
    rms_norms = not te and config.normalization == "RMSNorm"
    if rms_norms:
        swaps.append(_with_project_norms)
    swapped: dict[int, object] = {}  # the spec shares one layer spec among its dense (or MoE) layers
    for layer in block.layer_specs:
        if id(layer) not in swapped:
            swapped[id(layer)] = functools.reduce(lambda spec, swap: swap(spec), swaps, layer)
    block = replace(block, layer_specs=[swapped[id(layer)] for layer in block.layer_specs])
    return replace(block, layer_norm=_project_norm(block.layer_norm)) if rms_norms else block


def gpt_model_kwargs(model: dict, te: bool, layer_spec: dict) -> dict:
    """GPTModel's keyword arguments: without its RoPE where the project's core attention applies it
    (the local spec of a GQA family, `rope_theta` in the layer spec)."""
    if te or layer_spec.get("rope_theta") is None:
        return model
    return {**model, "position_embedding_type": "none"}


def transformer_config(config_class: str, **kwargs):
    """megatron-core's `TransformerConfig`, or `MLATransformerConfig` for MLA: `MegatronSpec.config_class`."""
    from megatron.core.transformer import transformer_config as configs

    return getattr(configs, config_class)(**kwargs)
