"""param_count of the shipped DSA configs (DeepSeek-V3.2, GLM-5) against the published figures.

Published figures:
  DeepSeek-V3.2: 671B total / 37B activated, MTP module excluded. These are DeepSeek-V3's figures
    (technical report arXiv 2412.19437, https://huggingface.co/deepseek-ai/DeepSeek-V3), which the
    V3.2 material repeats: V3.2 is V3 plus the lightning indexers (61 x 13.96M = 0.85B, all used by
    every token). So the total is checked against 671B (ours 671.88B, +0.1%) and the activated
    figure against V3's architecture: ours without the indexers is 37.55B (+1.5%, embeddings and
    LM head included as DeepSeek counts them); with them it is 38.40B (+3.8% vs 37B).
  GLM-5: 744B total / 40B activated (https://huggingface.co/zai-org/GLM-5 model card, recalled, not
    re-read offline). Z.ai's activated figures leave out the embedding and LM head (GLM-4.5's
    32B matches only that way, see test_param_counts_gqa_moe.py): ours without them is 39.88B
    (-0.3%; 41.78B with them). Ours total is 743.91B (-0.01%) without the MTP layer we do not build.
"""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from miles.config.schema import ModelCfg
from miles.models import param_count
from miles.models.causal_lm import CausalLM

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"


def load_arch(name: str):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / f"{name}.yaml")))
    return cfg.arch(cfg.vocab_size)


def indexer_params(arch) -> int:
    with torch.device("meta"):
        model = CausalLM(arch)
    return sum(p.numel() for name, p in model.named_parameters() if ".indexer." in name)


def near(value: float, published: float) -> bool:
    return abs(value / published - 1) < 0.02


def test_deepseek_v3_2_param_count():
    arch = load_arch("deepseek_v3_2")
    total, active = param_count(arch)
    # indexer per layer: wq_b 1536 x 64*128, wk 7168 x 128, k_norm 2 x 128, weights_proj 7168 x 64
    per_layer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert indexer_params(arch) == 61 * per_layer
    assert near(total, 671e9), total
    assert near(active - 61 * per_layer, 37e9), active  # V3's activated figure, see the module doc


def test_glm5_param_count():
    arch = load_arch("glm5")
    total, active = param_count(arch)
    embeddings = 2 * arch.vocab_size * arch.hidden_size  # input embedding + LM head (untied)
    assert near(total, 744e9), total
    assert near(active - embeddings, 40e9), active  # Z.ai's convention, see the module doc


@pytest.mark.parametrize("name", ["deepseek_v3_2", "glm5"])
def test_dsa_is_on_every_layer_of_the_full_size_configs(name):
    arch = load_arch(name)
    assert arch.dsa is not None and arch.dsa.index_topk == 2048 and not arch.dsa.shared_layers
    assert indexer_params(arch) > 0
