"""DeepSeek-V3 (and Kimi K2, same architecture) and GLM-4.7-Flash (glm4_moe_lite) through the
shared zoo checks: tiny transformers models with every feature of the family (MLA with q LoRA,
YaRN with DeepSeek's softmax correction, sigmoid router with correction bias, group-limited top-k,
routed scaling, a shared expert, dense-first layers), plus checkpoint-only details (MTP layers
skipped, Kimi's model_type, Kimi K2.5's nested text model)."""

import json

import torch
import transformers
from safetensors.torch import load_file, save_file

from miles.models import from_pretrained
from miles.models.config import from_hf_config
from zoo_checks import (check_decode_matches_forward, check_loads_transformers_checkpoint,
                        check_transformers_loads_ours, max_diff, random_ids, tiny_hf_model)

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.7)


def tiny_deepseek_v3(**overrides) -> transformers.DeepseekV3Config:
    kw = dict(vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
              topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=24,
              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, num_mtp_layers=0,
              max_position_embeddings=64, rope_parameters=YARN)
    kw.update(overrides)
    return transformers.DeepseekV3Config(**kw)


def tiny_glm4_moe_lite(**overrides):
    kw = dict(vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
              topk_group=1, n_shared_experts=1, routed_scaling_factor=1.8, q_lora_rank=24, kv_lora_rank=16,
              qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
              mlp_layer_types=["dense", "sparse", "dense", "sparse"],
              rope_parameters=dict(rope_type="default", rope_theta=1e6))
    kw.update(overrides)
    return transformers.Glm4MoeLiteConfig(**kw)


def randomized(hf_model):
    """zoo_checks randomizes parameters only; e_score_correction_bias is a buffer in transformers.
    A bias of the size of the score gaps changes which experts win, so a dropped bias would show."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, buf in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
    return hf_model


def test_deepseek_v3_passes_the_zoo_checks(tmp_path):
    hf = randomized(tiny_hf_model(tiny_deepseek_v3()))
    ours = check_loads_transformers_checkpoint(hf, tmp_path)
    assert ours.layers[2].mlp.gate.e_score_correction_bias.abs().sum() > 0
    assert [ours.config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    check_transformers_loads_ours(ours, tmp_path)
    check_decode_matches_forward(ours)


def test_glm4_moe_lite_passes_the_zoo_checks(tmp_path):
    hf = randomized(tiny_hf_model(tiny_glm4_moe_lite()))
    ours = check_loads_transformers_checkpoint(hf, tmp_path)
    assert ours.layers[3].mlp.gate.e_score_correction_bias.abs().sum() > 0
    assert [ours.config.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert ours.config.mlp_only_layers == [2]
    check_transformers_loads_ours(ours, tmp_path)
    check_decode_matches_forward(ours)


def _add_mtp_layer(path, num_layers):
    """Write what released checkpoints hold beyond num_hidden_layers: one MTP decoder layer."""
    tensors = load_file(str(path / "model.safetensors"))
    prefix = f"model.layers.{num_layers}."
    extra = {prefix + k: torch.zeros(4) for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
    extra[prefix + "eh_proj.weight"] = torch.zeros(4, 8)
    extra[prefix + "self_attn.kv_a_layernorm.weight"] = torch.zeros(4)
    save_file({**tensors, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def test_mtp_tensors_of_a_checkpoint_declaring_no_mtp_layer_are_skipped(tmp_path):
    # With num_nextn_predict_layers >= 1 they load as MTP modules (tests/unit/models/test_mtp.py).
    hf = randomized(tiny_hf_model(tiny_deepseek_v3()))
    hf.save_pretrained(tmp_path / "hf")
    _add_mtp_layer(tmp_path / "hf", 3)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    ours = from_pretrained(tmp_path / "hf")
    assert ours.config.mtp_layers == 0
    ids = random_ids(96)
    assert max_diff(ours(ids), hf(ids).logits) < 1e-5


@torch.no_grad()
def test_kimi_k2_and_k25_checkpoints_read_as_deepseek_v3(tmp_path):
    hf = tiny_hf_model(tiny_deepseek_v3())
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert from_hf_config({**config, "model_type": "kimi_k2"}) == from_hf_config(config)
    # Kimi K2.5: the text model nested under text_config / language_model., a vision tower beside it.
    k25 = tmp_path / "k25"
    k25.mkdir()
    (k25 / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                                                "text_config": {**config, "model_type": "kimi_k2"},
                                                "vision_config": {"hidden_size": 8}}))
    tensors = {"language_model." + k: v for k, v in load_file(str(tmp_path / "hf" / "model.safetensors")).items()}
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(8, 3)
    tensors["mm_projector.proj.0.weight"] = torch.zeros(8, 8)
    save_file(tensors, str(k25 / "model.safetensors"), metadata={"format": "pt"})
    ours = from_pretrained(k25)
    assert ours.config.family == "deepseek_v3"
    ids = random_ids(96)
    assert max_diff(ours(ids), hf(ids).logits) < 1e-5
