"""GLM-4.5V (glm4v_moe: the GLM-4.x MoE decoder) against transformers'
Glm4vMoeForConditionalGeneration (vlm_checks.py): mRoPE on the partial rotary width, the learned
position grid resampled bicubically to three image sizes, the downsample and the SwiGLU merger,
the sigmoid router with a randomized correction bias, group-limited top-k, routed scaling, the
shared expert and the dense first layer; the published config reads with the published size and
the release's MTP layer is skipped.
"""

import dataclasses

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from miles.models import from_hf_config, from_pretrained
from vlm_checks import (END, IMAGE, START, VIDEO, check_engine_and_trainer_match_transformers,
                        check_loads_transformers_checkpoint, check_transformers_loads_ours,
                        param_count, tiny_hf_model)

PATCH = 14
MODEL = transformers.Glm4vMoeForConditionalGeneration


def _hf_config():
    # head_dim 32, partial rotary 0.5: mRoPE [2, 3, 3] over the first 16 dims of each head.
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, moe_intermediate_size=24, n_routed_experts=4,
                num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3],
                                 "partial_rotary_factor": 0.5})
    # image_size 56 / patch 14: a 4 x 4 learned position grid.
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                  spatial_merge_size=2, temporal_patch_size=2, image_size=56)
    return transformers.Glm4vMoeConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                       video_token_id=VIDEO, image_start_token_id=START, image_end_token_id=END)


def test_transformers_checkpoint_matches_logits_with_images(tmp_path):
    ours = check_loads_transformers_checkpoint(tiny_hf_model(MODEL, _hf_config()), tmp_path, PATCH)
    cfg = ours.config
    assert (cfg.family, cfg.rotary_dim, cfg.mrope_section, cfg.mrope_interleaved) == ("glm4v_moe", 16, [2, 3, 3], False)
    assert (cfg.vision.num_position_embeddings, cfg.vision.vision_start_token_id, cfg.qk_norm) == (16, START, False)
    assert ours.layers[2].mlp.gate.e_score_correction_bias.abs().sum() > 0  # the randomized bias was loaded


def test_transformers_loads_our_checkpoint_and_round_trip(tmp_path):
    check_transformers_loads_ours(MODEL, _hf_config(), tmp_path, PATCH)


def test_the_releases_mtp_layer_is_skipped(tmp_path):
    """GLM-4.5V's checkpoint holds an MTP layer past the decoder (transformers ignores it too)."""
    tiny_hf_model(MODEL, _hf_config()).save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.language_model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert from_pretrained(tmp_path).config.num_layers == 3


def test_decoder_rules():
    cfg = from_hf_config(_hf_config().to_dict())
    with pytest.raises(ValueError, match="no QK-norm"):
        dataclasses.replace(cfg, qk_norm=True)
    with pytest.raises(ValueError, match=r"glm4v_moe decoder \(glm4_moe rules\).*sigmoid"):
        dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, scoring="softmax"))


# zai-org/GLM-4.5V's config.json (the released layout: mRoPE under rope_scaling).
GLM_4_5V = {
    "model_type": "glm4v_moe", "image_start_token_id": 151339, "image_end_token_id": 151340,
    "video_start_token_id": 151341, "video_end_token_id": 151342, "image_token_id": 151363, "video_token_id": 151364,
    "tie_word_embeddings": False,
    "text_config": {"model_type": "glm4v_moe_text", "pad_token_id": 151329, "vocab_size": 151552,
                    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "attention_bias": True,
                    "first_k_dense_replace": 1, "hidden_size": 4096, "intermediate_size": 10944,
                    "max_position_embeddings": 65536, "moe_intermediate_size": 1408, "n_group": 1,
                    "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96,
                    "num_experts_per_tok": 8, "num_hidden_layers": 46, "num_key_value_heads": 8,
                    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                    "rope_scaling": {"type": "default", "mrope_section": [8, 12, 12]}, "routed_scaling_factor": 1.0,
                    "topk_group": 1, "use_qk_norm": False},
    "vision_config": {"attention_bias": False, "depth": 24, "hidden_act": "silu", "hidden_size": 1536,
                      "image_size": 336, "in_channels": 3, "intermediate_size": 10944, "model_type": "glm4v_moe",
                      "num_heads": 12, "out_hidden_size": 4096, "patch_size": 14, "rms_norm_eps": 1e-5,
                      "spatial_merge_size": 2, "temporal_patch_size": 2}}


def test_published_config_reads():
    """Model card: 108B parameters (ours 107.71B: the decoder is GLM-4.5-Air's without its MTP layer)."""
    cfg = from_hf_config(GLM_4_5V)
    assert (cfg.rotary_dim, cfg.mrope_section, cfg.vision.num_position_embeddings) == (64, [8, 12, 12], 576)
    assert (cfg.vision.image_token_id, cfg.vision.vision_start_token_id) == (151363, 151339)
    assert abs(param_count(GLM_4_5V) / 108e9 - 1) < 0.005


def test_native_engine_and_trainer_with_images(tmp_path):
    check_engine_and_trainer_match_transformers("glm4v_moe_tiny", MODEL, tmp_path / "init")
