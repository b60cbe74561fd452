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


# The text_config of the published config.json files (the URLs in the yaml headers), as the
# multimodal llama4 checkpoints nest it.
_COMMON = dict(model_type="llama4_text", attention_bias=False, attention_chunk_size=8192, attn_scale=0.1,
               bos_token_id=200000, eos_token_id=[200001, 200007, 200008], pad_token_id=200018, floor_scale=8192,
               head_dim=128, hidden_act="silu", hidden_size=5120, intermediate_size=8192,
               intermediate_size_mlp=16384, no_rope_layers=[], num_attention_heads=40, num_experts_per_tok=1,
               num_hidden_layers=48, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
               tie_word_embeddings=False, vocab_size=202048)
PUBLISHED_TEXT_CONFIGS = {
    "llama4_scout": {**_COMMON, "attn_temperature_tuning": 4, "interleave_moe_layer_step": 1,
                     "max_position_embeddings": 10485760, "num_local_experts": 16, "use_qk_norm": True,
                     "moe_layers": list(range(48)),
                     "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "llama4_maverick": {**_COMMON, "interleave_moe_layer_step": 2, "max_position_embeddings": 1048576,
                        "num_local_experts": 128, "use_qk_norm": False, "rope_scaling": None},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_TEXT_CONFIGS))
def test_published_checkpoint_config_reads_as_the_shipped_yaml(name):
    """model.hf_checkpoint=<the published repo> yields the same architecture as model=<name>
    (token ids aside: the yaml leaves them to the tokenizer)."""
    import dataclasses

    from miles.models import ArchConfig, from_hf_config

    d = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
         "text_config": PUBLISHED_TEXT_CONFIGS[name], "vision_config": {"model_type": "llama4_vision_model"}}
    got = from_hf_config(d)
    want = load_arch(name)
    fields = {f.name: getattr(want, f.name) for f in dataclasses.fields(ArchConfig)}
    fields.update(bos_token_id=200000, eos_token_id=[200001, 200007, 200008], pad_token_id=200018)
    assert got == ArchConfig(**fields)
