"""param_count of the shipped Qwen3-MoE, GLM-4.5 family and MiniMax-M2 configs lands within 2% of the
published totals.

Published figures (total, activated):
  Qwen3-30B-A3B 30.5B / 3.3B, Qwen3-235B-A22B 235B / 22B: the model cards
    (https://huggingface.co/Qwen/Qwen3-30B-A3B, https://huggingface.co/Qwen/Qwen3-235B-A22B,
    "Number of Parameters" / "Number of Activated Parameters"), embeddings included.
  GLM-4.5 355B / 32B, GLM-4.5-Air 106B / 12B: https://huggingface.co/zai-org/GLM-4.5 and the GLM-4.5
    report (arXiv 2508.06471); GLM-4.6 / GLM-4.7 keep the GLM-4.5 architecture (355B / 32B).
  MiniMax-M2 / M2.1 230B / 10B: https://huggingface.co/MiniMaxAI/MiniMax-M2 ("230 billion total
    parameters with 10 billion active parameters").
Convention of the activated figures: Qwen counts the embedding and LM head (our active 3.35B / 22.19B;
without them 2.73B / 20.95B would miss), GLM and MiniMax leave them out (our active without them:
GLM-4.5 32.08B, Air 12.18B, MiniMax-M2 9.80B; with them 33.63B / 13.42B / 11.03B would miss). The
test compares like with like. MiniMax's "10B" is rounded to one digit; ours is 2.0% below it.
Totals always include embeddings; GLM's 355B also includes its MTP layer, which we do not build
(ours 352.8B, -0.6%).
"""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from miles.config.schema import ModelCfg
from miles.models import param_count

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
# name: (total, activated, activated figure counts the embedding and LM head)
PUBLISHED = {
    "qwen3_30b_a3b": (30.5e9, 3.3e9, True),
    "qwen3_235b_a22b": (235e9, 22e9, True),
    "glm4_5": (355e9, 32e9, False),
    "glm4_5_air": (106e9, 12e9, False),
    "glm4_6": (355e9, 32e9, False),
    "glm4_7": (355e9, 32e9, False),
    "minimax_m2": (230e9, 10e9, False),
    "minimax_m2_1": (230e9, 10e9, False),
}


def load_arch(name: str):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / f"{name}.yaml")))
    return cfg.arch(cfg.vocab_size)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_param_count_matches_published(name):
    arch = load_arch(name)
    total, active = param_count(arch)
    pub_total, pub_active, with_embeddings = PUBLISHED[name]
    if not with_embeddings:
        active -= 2 * arch.vocab_size * arch.hidden_size  # untied embedding + LM head
    assert abs(total / pub_total - 1) < 0.02, f"{name}: total {total / 1e9:.2f}B vs {pub_total / 1e9}B"
    assert abs(active / pub_active - 1) < 0.02, f"{name}: active {active / 1e9:.2f}B vs {pub_active / 1e9}B"


def test_moe_active_count_is_hand_computed():
    # Qwen3-30B-A3B: a token uses 8 of 128 experts of 3 x 2048 x 768 weights in each of 48 layers.
    arch = load_arch("qwen3_30b_a3b")
    total, active = param_count(arch)
    assert total - active == 48 * (128 - 8) * 3 * 2048 * 768
