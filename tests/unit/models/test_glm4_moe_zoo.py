"""GLM-4.5 family (glm4_moe) through the shared zoo checks (see zoo_checks.py)."""

import pytest
import torch
import transformers

from zoo_checks import (check_decode_matches_forward, check_loads_transformers_checkpoint,
                        check_transformers_loads_ours, tiny_hf_model)


def randomize_router_bias(hf_model, seed: int = 7) -> None:
    """zoo_checks randomizes parameters only; e_score_correction_bias is a buffer in transformers.
    A bias of the size of the score gaps changes which experts win, so a dropped bias would show."""
    gen = torch.Generator().manual_seed(seed)
    for name, buf in hf_model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)


def _config(**kw):
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
              norm_topk_prob=True, attention_bias=True, partial_rotary_factor=0.5, num_mtp_layers=0) | kw
    return transformers.Glm4MoeConfig(**kw)


@pytest.mark.parametrize("qk_norm", [True, False])  # GLM-4.5 / 4.6 / 4.7 use it, GLM-4.5-Air does not
def test_glm4_moe_passes_the_zoo_checks(tmp_path, qk_norm):
    hf = tiny_hf_model(_config(use_qk_norm=qk_norm))
    with torch.no_grad():
        randomize_router_bias(hf)
    ours = check_loads_transformers_checkpoint(hf, tmp_path)
    assert ours.config.rotary_dim == 8 and ours.config.qk_norm == qk_norm
    assert ours.layers[2].mlp.gate.e_score_correction_bias.abs().sum() > 0
    check_transformers_loads_ours(ours, tmp_path)
    check_decode_matches_forward(ours)


def test_glm4_moe_ignores_the_mtp_layer(tmp_path):
    """Released GLM-4.5 checkpoints hold the MTP layer as model.layers.<num_hidden_layers>.*."""
    from safetensors.torch import load_file, save_file

    from miles.models import from_pretrained

    hf = tiny_hf_model(_config())
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert from_pretrained(tmp_path).config.num_layers == 3
