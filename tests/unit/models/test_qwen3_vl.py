"""Qwen3-VL (qwen3_vl: Qwen3 decoder) and Qwen3-VL-MoE (qwen3_vl_moe: Qwen3-MoE decoder) against
transformers' Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration (vlm_checks.py):
interleaved mRoPE, the learned position grid resampled to three image sizes, DeepStack features
from two tower blocks added after the first two decoder layers; the published configs read with
the published parameter counts.
"""

import copy
import dataclasses

import pytest
import transformers
from safetensors import safe_open

from miles.models import from_hf_config, save_pretrained
from miles.models.vlm import VisionLM
from vlm_checks import (END, IMAGE, START, VIDEO, check_engine_and_trainer_match_transformers,
                        check_loads_transformers_checkpoint, check_transformers_loads_ours,
                        param_count, tiny_hf_model)

PATCH = 16
CLASSES = {"qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
           "qwen3_vl_moe": (transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration)}


def _hf_config(family):
    # mrope_section [4, 2, 2] of 8 frequencies: interleaved t h w t h w t t (consecutive would differ).
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2]})
    if family == "qwen3_vl_moe":
        text.update(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    # A 4 x 4 learned position grid: the 8 x 12 image upsamples it, the 6 x 2 one resamples it unevenly.
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 2])
    return CLASSES[family][0](text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=START, vision_end_token_id=END)


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_transformers_checkpoint_matches_logits_with_images(tmp_path, family):
    ours = check_loads_transformers_checkpoint(tiny_hf_model(CLASSES[family][1], _hf_config(family)), tmp_path, PATCH)
    cfg = ours.config
    assert (cfg.family, cfg.mrope_section, cfg.mrope_interleaved) == (family, [4, 2, 2], True)
    assert cfg.vision.deepstack_visual_indexes == [0, 2] and len(ours.visual.deepstack_merger_list) == 2
    assert (cfg.moe is not None) == (family == "qwen3_vl_moe")


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_transformers_loads_our_checkpoint_and_round_trip(tmp_path, family):
    check_transformers_loads_ours(CLASSES[family][1], _hf_config(family), tmp_path, PATCH)


def test_moe_experts_are_saved_in_the_release_layout_and_read_in_both(tmp_path):
    """The release stores fused experts transposed ([E, H, 2I] / [E, I, H]); transformers 5 saves
    its in-memory layout. We write the release's and read both (the other test reads transformers')."""
    cfg = from_hf_config(_hf_config("qwen3_vl_moe").to_dict())
    save_pretrained(VisionLM(cfg, seed=0), tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        prefix = "model.language_model.layers.0.mlp.experts."
        assert tuple(f.get_slice(prefix + "gate_up_proj").get_shape()) == (4, 64, 48)
        assert tuple(f.get_slice(prefix + "down_proj").get_shape()) == (4, 24, 64)


def test_decoder_rules_of_the_text_family_apply():
    """A Qwen3-VL decoder obeys qwen3's rules (read from config.json or set in a model config); the
    MoE router always renormalizes (as HF's)."""
    d = _hf_config("qwen3_vl").to_dict()
    d["text_config"]["attention_bias"] = True
    with pytest.raises(ValueError, match="attention_bias"):
        from_hf_config(d)
    cfg = from_hf_config(_hf_config("qwen3_vl").to_dict())
    with pytest.raises(ValueError, match=r"qwen3_vl decoder \(qwen3 rules\).*attention_bias"):
        dataclasses.replace(cfg, attention_bias=True)
    d = _hf_config("qwen3_vl_moe").to_dict()
    d["text_config"]["norm_topk_prob"] = False
    assert from_hf_config(d).moe.norm_topk_prob


# Qwen/Qwen3-VL-8B-Instruct's config.json (the released layout: mRoPE under rope_scaling).
QWEN3_VL_8B = {
    "model_type": "qwen3_vl", "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
    "text_config": {"attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
                    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 262144,
                    "model_type": "qwen3_vl_text", "num_attention_heads": 32, "num_hidden_layers": 36,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_theta": 5000000, "vocab_size": 151936,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}},
    "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1152, "in_channels": 3, "intermediate_size": 4304, "model_type": "qwen3_vl",
                      "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2}}


def _qwen3_vl_30b_a3b():
    """Qwen/Qwen3-VL-30B-A3B-Instruct's config.json: the same tower, the Qwen3-30B-A3B decoder."""
    d = copy.deepcopy(QWEN3_VL_8B)
    d["model_type"] = "qwen3_vl_moe"
    d["text_config"].update(model_type="qwen3_vl_moe_text", hidden_size=2048, intermediate_size=6144,
                            num_hidden_layers=48, num_key_value_heads=4, moe_intermediate_size=768, num_experts=128,
                            num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    d["vision_config"].update(model_type="qwen3_vl_moe", out_hidden_size=2048)
    return d


@pytest.mark.parametrize("config,published", [(QWEN3_VL_8B, 8.77e9), (_qwen3_vl_30b_a3b(), 31.1e9)])
def test_published_configs_read(config, published):
    """Model cards: Qwen3-VL-8B-Instruct 8.77B, Qwen3-VL-30B-A3B-Instruct 31.1B parameters."""
    cfg = from_hf_config(config)
    assert (cfg.mrope_section, cfg.mrope_interleaved, cfg.vision.num_position_embeddings) == ([24, 20, 20], True, 2304)
    assert abs(param_count(config) / published - 1) < 0.005



@pytest.mark.parametrize("conf_name,family", [("qwen3_vl_tiny", "qwen3_vl"), ("qwen3_vl_moe_tiny", "qwen3_vl_moe")])
def test_native_engine_and_trainer_with_images(tmp_path, conf_name, family):
    check_engine_and_trainer_match_transformers(conf_name, CLASSES[family][1], tmp_path / "init")
