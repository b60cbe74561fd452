"""MLA (miles.models.mla) and YaRN (miles.models.rope) against transformers' DeepseekV3.

Covers: YaRN inverse frequencies and attention factor bit-equal to transformers' init function;
an all-dense DeepSeek-V3 (first_k_dense_replace == num_layers) through the zoo checks, with and
without q compression, YaRN with the mscale_all_dim softmax correction, both RoPE layouts;
the decode cache holds only the compressed latent + rope key.
"""

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from miles.models import CausalLM
from miles.models.config import RopeScalingConfig
from miles.models.mla import MLACache
from miles.models.rope import inv_freq
from zoo_checks import (check_decode_matches_forward, check_loads_transformers_checkpoint,
                        check_transformers_loads_ours, tiny_hf_model)

YARN_CASES = [  # (rope_theta, rope dim, transformers rope_parameters)
    # DeepSeek-V3 / R1
    (10000.0, 64, dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                       mscale=1.0, mscale_all_dim=1.0)),
    # Kimi K2
    (50000.0, 64, dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=1, beta_slow=1,
                       mscale=1.0, mscale_all_dim=1.0)),
    # unequal mscales (attention factor != 1), Qwen-style plain yarn, explicit factor, no truncation
    (10000.0, 32, dict(factor=8.0, original_max_position_embeddings=2048, mscale=1.0, mscale_all_dim=0.7)),
    (1e6, 128, dict(factor=4.0, original_max_position_embeddings=32768)),
    (1e6, 128, dict(factor=4.0, original_max_position_embeddings=32768, attention_factor=1.3, truncate=False)),
]


@pytest.mark.parametrize("theta,dim,params", YARN_CASES)
def test_yarn_inv_freq_equals_transformers(theta, dim, params):
    hf = transformers.DeepseekV3Config(qk_rope_head_dim=dim, max_position_embeddings=params[
        "original_max_position_embeddings"] * int(params["factor"]),
        rope_parameters=dict(rope_type="yarn", rope_theta=theta, **params))
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours, factor = inv_freq(dim, theta, RopeScalingConfig(type="yarn", **params))
    assert torch.equal(ours, want)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def dense_deepseek(**overrides) -> transformers.DeepseekV3Config:
    """A 2-layer all-dense DeepSeek-V3 (MLA only), YaRN with DeepSeek's softmax correction."""
    kw = dict(vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
              topk_group=1, first_k_dense_replace=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=8, v_head_dim=12, num_mtp_layers=0, max_position_embeddings=64,
              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                                   beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.7))
    kw.update(overrides)
    return transformers.DeepseekV3Config(**kw)


@pytest.mark.parametrize("overrides", [
    {},  # q LoRA, YaRN, interleaved rope pairs
    dict(q_lora_rank=None, rope_interleave=False, attention_bias=True,
         rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
], ids=["q_lora_yarn_interleave", "q_proj_plain_rotate_half_bias"])
def test_dense_mla_model_passes_the_zoo_checks(tmp_path, overrides):
    ours = check_loads_transformers_checkpoint(tiny_hf_model(dense_deepseek(**overrides)), tmp_path)
    assert ours.config.mla is not None and not any(ours.config.is_moe_layer(i) for i in range(2))
    check_transformers_loads_ours(ours, tmp_path)
    check_decode_matches_forward(ours)


def test_cache_holds_the_compressed_latent_only(tmp_path):
    ours = check_loads_transformers_checkpoint(tiny_hf_model(dense_deepseek()), tmp_path)
    cache = ours.new_cache(3, 10)
    layer = cache.layers[0]
    assert isinstance(layer, MLACache)
    assert layer.kv.shape == (3, 10, 16 + 8)  # kv_lora_rank + qk_rope_head_dim, no head axis
