"""The released config.json files of Qwen3-MoE, GLM-4.5+ and MiniMax-M2 read into the same
architecture as our shipped configs, so `model.hf_checkpoint=/dir` alone gives the published model.

The dicts are the relevant keys of the files at the URLs in each conf/model/*.yaml, written from
memory (the model hub is not reachable here); transformers-5-written configs are covered by the
zoo checks.
"""

import pytest

from miles.models.config import from_hf_config
from test_param_counts_gqa_moe import load_arch

QWEN3_30B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_size": 2048, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
}
GLM4_5 = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "head_dim": 128,
    "hidden_size": 5120, "partial_rotary_factor": 0.5, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "moe_intermediate_size": 1536, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "use_qk_norm": True,
    "vocab_size": 151552, "pad_token_id": 151329,
}
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attn_type_list": [1] * 62,
    "head_dim": 128, "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608,
    "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
    "num_local_experts": 256, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
    "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
    "use_qk_norm": True, "use_routing_bias": True, "use_mtp": True, "num_mtp_modules": 3, "vocab_size": 200064,
}


def _glm_air():
    return GLM4_5 | {"hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                     "n_routed_experts": 128, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
                     "num_hidden_layers": 46, "use_qk_norm": False}


CASES = {
    "qwen3_30b_a3b": QWEN3_30B,
    "qwen3_235b_a22b": QWEN3_30B | {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94,
                                    "num_attention_heads": 64, "moe_intermediate_size": 1536},
    "glm4_5": GLM4_5,
    "glm4_5_air": _glm_air(),
    "glm4_6": GLM4_5 | {"max_position_embeddings": 202752},
    "minimax_m2": MINIMAX_M2,
}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # not part of our yaml files


@pytest.mark.parametrize("name", sorted(CASES))
def test_released_config_json_reads_as_the_shipped_config(name):
    ours = from_hf_config(CASES[name])
    shipped = load_arch(name)
    for key in TOKEN_IDS:
        setattr(ours, key, None)
    assert ours == shipped


def test_minimax_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="attn_type_list"):
        from_hf_config(MINIMAX_M2 | {"attn_type_list": [0, 1] * 31})
