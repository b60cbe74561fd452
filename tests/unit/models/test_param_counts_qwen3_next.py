"""param_count of qwen3_next_80b_a3b against the published figures and an independent hand count.

Published (https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct model card): "80B in total and 3B
activated", "Number of Parameters (Non-Embedding): 79B". param_count counts embeddings and the LM head
(2 x 151936 x 2048 = 0.62B): 79.67B total, 3.87B active. Without them: 79.05B total (the card's 79B)
and 3.25B active, which the card rounds to "3B" (the A3B of the name); so the activated figure is
checked without embeddings, against 3.25B computed by hand, and within 10% of the card's rounded 3B.
"""

from pathlib import Path

from omegaconf import OmegaConf

from miles.config.schema import ModelCfg
from miles.models import param_count

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"


def load_arch(name: str):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / f"{name}.yaml")))
    return cfg.arch(cfg.vocab_size)


def test_qwen3_next_80b_a3b_param_count_matches_published():
    arch = load_arch("qwen3_next_80b_a3b")
    total, active = param_count(arch)
    embeddings = 2 * 151936 * 2048  # untied embedding + LM head
    assert abs(total / 80e9 - 1) < 0.02, total
    assert abs((total - embeddings) / 79e9 - 1) < 0.02, total - embeddings
    assert abs((active - embeddings) / 3e9 - 1) < 0.10, active - embeddings


def test_qwen3_next_80b_a3b_param_count_equals_hand_count():
    h, experts, k = 2048, 512, 10
    deltanet = (h * (2 * 2048 + 2 * 4096)  # in_proj_qkvz: q, k (16 x 128), v, z (32 x 128)
                + h * 2 * 32  # in_proj_ba
                + (2 * 2048 + 4096) * 4  # depthwise conv over q | k | v, kernel 4
                + 32 + 32 + 128  # dt_bias, A_log, gated norm
                + 4096 * h)  # out_proj
    attention = h * 16 * 256 * 2 + 2 * h * 2 * 256 + 16 * 256 * h + 2 * 256  # q (+gate), k, v, o, q/k norm
    expert = 3 * h * 512
    moe = experts * expert + experts * h + expert + h  # experts, router, shared expert, its gate
    total = 36 * deltanet + 12 * attention + 48 * (moe + 2 * h) + h + 2 * 151936 * h
    active = total - 48 * (experts - k) * expert
    assert param_count(load_arch("qwen3_next_80b_a3b")) == (total, active) == (79_674_391_296, 3_874_929_408)
