"""param_count of the shipped Llama 4 configs lands within 2% of the published totals.

Published figures (total / active, embeddings included): the model cards
https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E ("17B (Activated) 109B (Total)") and
https://huggingface.co/meta-llama/Llama-4-Maverick-17B-128E ("17B (Activated) 400B (Total)").
Both count the text model only (the vision encoder is under 1B).
"""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from miles.config.schema import ModelCfg
from miles.models import param_count

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
PUBLISHED = {"llama4_scout": (109e9, 17e9), "llama4_maverick": (400e9, 17e9)}


def load_arch(name: str):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / f"{name}.yaml")))
    return cfg.arch(cfg.vocab_size)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_llama4_param_count_matches_published(name):
    total, active = param_count(load_arch(name))
    want_total, want_active = PUBLISHED[name]
    assert abs(total / want_total - 1) < 0.02, f"{name}: total {total / 1e9:.2f}B vs {want_total / 1e9}B"
    assert abs(active / want_active - 1) < 0.02, f"{name}: active {active / 1e9:.2f}B vs {want_active / 1e9}B"


def test_llama4_moe_layers_interleave():
    scout, maverick = load_arch("llama4_scout"), load_arch("llama4_maverick")
    assert all(scout.is_moe_layer(i) for i in range(48))
    assert [maverick.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    # Maverick: 24 MoE layers of 128 experts + 24 dense layers of width 16384; each token uses one
    # routed expert + the shared expert (2 x 8192 wide = one dense layer) in MoE layers, so active
    # equals Scout's up to the routers (Maverick 24 x 128 x 5120, Scout 48 x 16 x 5120).
    routers = 24 * 128 * 5120 - 48 * 16 * 5120
    assert param_count(maverick)[1] - param_count(scout)[1] == routers
