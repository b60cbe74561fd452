"""Qwen3-MoE through the shared zoo checks (see zoo_checks.py), plus the checkpoint layouts."""

import json

import torch
import transformers
from safetensors import safe_open

from miles.models import from_pretrained
from zoo_checks import (check_decode_matches_forward, check_loads_transformers_checkpoint,
                        check_transformers_loads_ours, tiny_hf_model)


def _config(**kw):
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
              norm_topk_prob=True) | kw
    return transformers.Qwen3MoeConfig(**kw)


def test_qwen3_moe_passes_the_zoo_checks(tmp_path):
    # layer 1 dense (mlp_only_layers) keeps the dense-MLP path of the family covered
    ours = check_loads_transformers_checkpoint(tiny_hf_model(_config(mlp_only_layers=[1])), tmp_path)
    check_transformers_loads_ours(ours, tmp_path)
    check_decode_matches_forward(ours)
    # on disk: one tensor per expert, as released checkpoints and transformers 5 write them
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)


def test_qwen3_moe_loads_fused_expert_tensors(tmp_path):
    """A checkpoint holding transformers' in-memory layout (fused experts) loads too."""
    from safetensors.torch import save_file

    hf = tiny_hf_model(_config(norm_topk_prob=False))
    (tmp_path / "fused").mkdir()
    hf.config.save_pretrained(tmp_path / "fused")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "fused" / "model.safetensors"))
    ours = from_pretrained(tmp_path / "fused")
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-5
    assert json.loads((tmp_path / "fused" / "config.json").read_text())["norm_topk_prob"] is False
