"""param_count of the shipped Qwen dense configs lands within 2% of the published totals.

Published figures: the model cards of https://huggingface.co/Qwen (Qwen2.5-*: "Number of Parameters";
Qwen3-*: "Number of Parameters"), both counting embeddings.
"""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from miles.config.schema import ModelCfg
from miles.models import param_count

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
PUBLISHED = {
    "qwen2_5_0_5b": 0.49e9, "qwen2_5_1_5b": 1.54e9, "qwen2_5_3b": 3.09e9, "qwen2_5_7b": 7.61e9,
    "qwen2_5_14b": 14.7e9, "qwen2_5_32b": 32.5e9,
    "qwen3_0_6b": 0.6e9, "qwen3_1_7b": 1.7e9, "qwen3_4b": 4.0e9, "qwen3_8b": 8.2e9, "qwen3_14b": 14.8e9,
    "qwen3_32b": 32.8e9,
}


def load_arch(name: str):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / f"{name}.yaml")))
    return cfg.arch(cfg.vocab_size)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_dense_qwen_param_count_matches_published(name):
    total, active = param_count(load_arch(name))
    assert total == active  # dense: every parameter is used by every token
    assert abs(total / PUBLISHED[name] - 1) < 0.02, f"{name}: {total / 1e9:.3f}B vs {PUBLISHED[name] / 1e9}B"


def test_param_count_equals_hand_computed_for_a_small_qwen3():
    # embed 64x32 (tied) + per layer: q 32x(4*16) + k,v 32x(2*16) each + o (4*16)x32 + q/k norm 16 each
    # + mlp 3 x 32x64 + 2 layer norms 32 each; + final norm 32.
    arch = load_arch("qwen3_0_6b")
    arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers = 64, 32, 64, 2
    arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.tie_word_embeddings = 4, 2, 16, True
    per_layer = 32 * 64 + 2 * 32 * 32 + 64 * 32 + 2 * 16 + 3 * 32 * 64 + 2 * 32
    assert param_count(arch) == (64 * 32 + 2 * per_layer + 32,) * 2
