"""MiniMax-M2 family (minimax_m2) through the shared zoo checks (see zoo_checks.py)."""

import torch
import transformers
from safetensors import safe_open

from test_glm4_moe_zoo import randomize_router_bias
from zoo_checks import (check_decode_matches_forward, check_loads_transformers_checkpoint,
                        check_transformers_loads_ours, tiny_hf_model)


def test_minimax_m2_passes_the_zoo_checks(tmp_path):
    cfg = transformers.MiniMaxM2Config(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, rotary_dim=8,
        bos_token_id=1, eos_token_id=2)
    hf = tiny_hf_model(cfg)
    with torch.no_grad():
        randomize_router_bias(hf)
    ours = check_loads_transformers_checkpoint(hf, tmp_path)
    assert ours.config.rotary_dim == 8 and ours.layers[0].self_attn.q_norm.weight.shape == (64,)
    check_transformers_loads_ours(ours, tmp_path)
    check_decode_matches_forward(ours)
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # the released checkpoints' (Mixtral) spelling
    assert {"model.layers.1.block_sparse_moe.experts.5.w3.weight",
            "model.layers.1.block_sparse_moe.e_score_correction_bias"} <= names
