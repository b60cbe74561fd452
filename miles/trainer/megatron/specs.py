"""The GPTModel decoder block spec for an architecture: which modules megatron-core builds per layer."""

from __future__ import annotations


def decoder_block_spec(config, te: bool, layer_spec: dict):
    """megatron-core's GPT decoder block spec for `config` (a TransformerConfig): Transformer Engine's
    modules when `te`, the local (plain torch) ones otherwise; `layer_spec` from miles.trainer.megatron.arch."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=te, **layer_spec)
