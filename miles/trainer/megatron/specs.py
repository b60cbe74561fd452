"""The GPTModel decoder block spec for an architecture: which modules megatron-core builds per layer.

Without Transformer Engine the spec is megatron-core's local one with the core attention swapped for
the project's (miles/trainer/megatron/core_attention.py: PyTorch SDPA instead of the local
DotProductAttention's materialised [heads, L, L] scores; it takes MLA's k / v head dims too).
"""

from __future__ import annotations

from dataclasses import replace


def _with_core_attention(layer, core_attention):
    """A copy of a TransformerLayer spec whose self-attention builds `core_attention`."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    attention = layer.submodules.self_attention
    if attention.submodules.core_attention is not DotProductAttention:
        raise ValueError(f"the local spec's core attention is {attention.submodules.core_attention}, "
                         "not the DotProductAttention this swap replaces")
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=core_attention))
    return replace(layer, submodules=replace(layer.submodules, self_attention=attention))


def decoder_block_spec(config, te: bool, layer_spec: dict):
    """megatron-core's GPT decoder block spec for `config` (a TransformerConfig, or an
    MLATransformerConfig): Transformer Engine's modules when `te`, else the local (plain torch) ones
    with the project's core attention; `layer_spec` from miles.trainer.megatron.arch."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, **layer_spec)
    if te:
        return block
    from miles.trainer.megatron.core_attention import SDPACoreAttention

    swapped: dict[int, object] = {}  # the local spec shares one layer spec among its dense (or MoE) layers
    layers = [swapped.setdefault(id(layer), _with_core_attention(layer, SDPACoreAttention))
              for layer in block.layer_specs]
    return replace(block, layer_specs=layers)
