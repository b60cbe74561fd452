"""DeepSeek Sparse Attention: the lightning indexer against transformers' indexer modules, the
DeepSeek-V3.2 and GLM-5 families through the zoo checks, and proof that the sparsity is active."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

from miles.models.config import DSAConfig, MLAConfig
from miles.models.context import ForwardContext
from miles.models.dsa import DSACache, LightningIndexer, topk_keep
from zoo_checks import (check_decode_matches_forward, check_loads_transformers_checkpoint,
                         check_transformers_loads_ours, max_diff, random_ids, randomize, tiny_hf_model)

HIDDEN, Q_LORA, ROPE, IDX_HEADS, IDX_DIM, TOPK = 32, 24, 8, 8, 16, 5


def _indexer_pair(glm: bool, seed: int = 0):
    """transformers' indexer and ours with the same random weights."""
    cls, hf_cfg_cls = ((hf_glm.GlmMoeDsaIndexer, transformers.GlmMoeDsaConfig) if glm
                       else (hf_v32.DeepseekV32Indexer, transformers.DeepseekV32Config))
    hf_cfg = hf_cfg_cls(hidden_size=HIDDEN, q_lora_rank=Q_LORA, qk_rope_head_dim=ROPE, index_n_heads=IDX_HEADS,
                        index_head_dim=IDX_DIM, index_topk=TOPK, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = cls(hf_cfg, 0).eval()
    randomize(hf, seed)
    cfg = SimpleNamespace(hidden_size=HIDDEN, rope_theta=10000.0, rope_scaling=None,
                          mla=MLAConfig(q_lora_rank=Q_LORA, qk_rope_head_dim=ROPE),
                          dsa=DSAConfig(index_n_heads=IDX_HEADS, index_head_dim=IDX_DIM, index_topk=TOPK,
                                        rope_interleave=glm))
    ours = LightningIndexer(cfg, 0).eval()
    ours.load_state_dict(hf.state_dict())  # same parameter names as transformers
    rotary = (hf_glm.GlmMoeDsaRotaryEmbedding if glm else hf_v32.DeepseekV32RotaryEmbedding)(hf_cfg)
    return hf, ours, rotary


def _inputs(b: int, t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, HIDDEN, generator=gen), torch.randn(b, t, Q_LORA, generator=gen)


def _hf_keep(hf, rotary, x, q_latent, pos, visible):
    """transformers' selection as a mask, the way its eager attention scatters it. visible: [B, T, S]."""
    idx = hf(x, q_latent, rotary(x, pos), visible, pos).long()
    return torch.zeros(visible.shape, dtype=torch.bool).scatter(-1, idx, True) & visible


@pytest.mark.parametrize("glm", [False, True], ids=["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@torch.no_grad()
def test_indexer_selects_the_same_keys_as_transformers(glm, padded):
    hf, ours, rotary = _indexer_pair(glm)
    b, t = 3, 14
    mask = None
    if padded:
        mask = torch.ones(b, t, dtype=torch.long)
        mask[0, :4], mask[2, :9] = 0, 0
    pos = torch.arange(t).expand(b, t) if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    ctx = ForwardContext(pos, mask, 0)
    visible = ctx.mask()[:, 0].expand(b, t, t)
    total = 0
    for seed in range(4):
        x, q_latent = _inputs(b, t, seed)
        keep = ours(x, q_latent, ForwardContext(pos, mask, 0))[:, 0]
        ref = _hf_keep(hf, rotary, x, q_latent, pos, visible)
        assert torch.equal(keep, ref), (keep ^ ref).nonzero()
        # every query keeps min(topk, visible keys) keys
        assert torch.equal(keep.sum(-1), visible.sum(-1).clamp(max=TOPK))
        total += (visible.sum(-1) > TOPK).sum().item()
    assert total > 50  # the selection really drops keys for most queries


@pytest.mark.parametrize("glm", [False, True], ids=["deepseek_v32", "glm_moe_dsa"])
@torch.no_grad()
def test_indexer_decode_with_its_key_cache_matches_the_full_forward(glm):
    """Prefill of left-padded rows + one token per step through DSACache selects the same keys
    (and computes the same scores) as the full forward."""
    _, ours, _ = _indexer_pair(glm)
    b, t, prompt = 2, 11, 6
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    x, q_latent = _inputs(b, t, seed=7)
    full_ctx = ForwardContext(pos, mask, 0)
    full_scores, full_keep = ours.scores(x, q_latent, full_ctx), ours(x, q_latent, full_ctx)
    cache = DSACache(b, t, 4, ROPE, IDX_DIM, torch.float32, "cpu")
    for start, end in [(0, prompt)] + [(i, i + 1) for i in range(prompt, t)]:
        ctx = ForwardContext(pos[:, start:end], mask[:, :end], start)
        keep = ours(x[:, start:end], q_latent[:, start:end], ctx, cache)  # writes this step's keys
        scores = ours.scores(x[:, start:end], q_latent[:, start:end], ctx, cache)  # rewrites the same keys
        vis = full_ctx.mask()[:, 0, start:end, :end].expand(b, -1, -1)
        torch.testing.assert_close(scores.masked_fill(~vis, 0), full_scores[:, start:end, :end].masked_fill(~vis, 0),
                                   rtol=2e-6, atol=1e-6)  # fp32 scores ~1: a few ulps (AVX2 sums in another order)
        assert torch.equal(keep[:, 0], full_keep[:, 0, start:end, :end])


def test_topk_keep_breaks_ties_toward_earlier_keys_whatever_the_row_length():
    s = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0, float("-inf")]])
    assert topk_keep(s, 3).tolist() == [[True, True, False, False, True, False, False]]
    assert torch.equal(topk_keep(s[:, :6], 3), topk_keep(s, 3)[:, :6])
    assert topk_keep(torch.tensor([[1.0, float("-inf"), float("-inf")]]), 2).sum() == 2


# -- whole models --------------------------------------------------------------------------------

def _tiny_hf_config(glm: bool, **extra):
    """A tiny V3.2 / GLM-5 config with every feature: q LoRA, MLA, DSA with index_topk (4) below the
    test sequence lengths (9 and up), MoE with groups (V3.2), a shared expert, a dense first layer."""
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=8, index_n_heads=8, index_head_dim=16, index_topk=4, first_k_dense_replace=1,
                  routed_scaling_factor=2.5, max_position_embeddings=64)
    if glm:
        return transformers.GlmMoeDsaConfig(**common, **extra)
    return transformers.DeepseekV32Config(**common, n_group=4, topk_group=2, **extra)


def _zoo(hf_config, tmp_path):
    ours = check_loads_transformers_checkpoint(tiny_hf_model(hf_config), tmp_path)
    check_transformers_loads_ours(ours, tmp_path)
    check_decode_matches_forward(ours, prompt_lens=(3, 6, 9), new_tokens=4)
    return ours


def test_deepseek_v32_passes_the_zoo_checks(tmp_path):
    ours = _zoo(_tiny_hf_config(glm=False), tmp_path)
    assert ours.config.family == "deepseek_v32" and ours.config.dsa.index_topk == 4
    assert not ours.config.dsa.rope_interleave


def test_glm_moe_dsa_passes_the_zoo_checks(tmp_path):
    ours = _zoo(_tiny_hf_config(glm=True), tmp_path)
    assert ours.config.family == "glm_moe_dsa" and ours.config.dsa.rope_interleave


def test_glm_moe_dsa_with_shared_indexer_layers_passes_the_zoo_checks(tmp_path):
    """Layer 2 reuses layer 1's selection (GLM IndexShare) and has no indexer of its own."""
    ours = _zoo(_tiny_hf_config(glm=True, indexer_types=["full", "full", "shared"]), tmp_path)
    assert ours.config.dsa.shared_layers == [2]
    assert ours.layers[2].self_attn.indexer is None


@torch.no_grad()
def test_sparsity_is_active(tmp_path):
    """With index_topk (4) below the sequence length the output differs from dense MLA (same weights,
    index_topk raised to the length) at every position past the 4th, and equals it before."""
    ours = check_loads_transformers_checkpoint(tiny_hf_model(_tiny_hf_config(glm=False)), tmp_path)
    dense = copy.deepcopy(ours)
    for layer in dense.layers:
        layer.self_attn.indexer.topk = 10 ** 6
    ids = random_ids(64, batch=2, length=12)
    sparse_logits, dense_logits = ours(ids), dense(ids)
    assert max_diff(sparse_logits[:, :4], dense_logits[:, :4]) < 1e-5
    per_position = (sparse_logits - dense_logits).abs().amax(dim=(0, 2))
    assert (per_position[4:] > 1e-3).all(), per_position


def test_deepseek_v32_with_yarn_passes_the_zoo_checks(tmp_path):
    """YaRN as in the released model, with mscale != mscale_all_dim so that the cos / sin attention
    factor (which the indexer's RoPE shares) and the softmax-scale correction are both not 1."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5}
    ours = _zoo(_tiny_hf_config(glm=False, rope_parameters=yarn), tmp_path)
    assert ours.config.rope_scaling.type == "yarn"


@pytest.mark.parametrize("name", ["deepseek_v3_2_tiny", "glm5_tiny"])
def test_tiny_configs_round_trip_through_transformers(name, tmp_path):
    """The shipped tiny variants: config.json round trip, transformers loads our checkpoint with the
    same logits (GLM's shared-index layer included), decode equals forward. Exact index-score ties at
    the top-k cut (keys whose indexer heads the ReLU all zeroes) are broken earliest-first here and
    arbitrarily by transformers' torch.topk; with 8 indexer heads and these seeds there are none."""
    from omegaconf import OmegaConf

    from miles.config.schema import ModelCfg
    from miles.models import CausalLM, from_hf_config

    conf = Path(__file__).resolve().parents[3] / "conf" / "model" / f"{name}.yaml"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(conf)))
    arch = cfg.arch(64)
    assert from_hf_config(arch.to_hf_config()) == arch
    assert arch.dsa.index_topk < 12  # below the lengths checked here: the sparsity is active
    model = CausalLM(arch, seed=0)
    randomize(model, seed=3)
    check_transformers_loads_ours(model, tmp_path)
    check_decode_matches_forward(model, prompt_lens=(5, 9, 12), new_tokens=3)


@torch.no_grad()
def test_decode_matches_forward_when_every_index_score_ties(tmp_path):
    """All indexer scores exactly 0 (wq_b zeroed): every cut is a tie. torch.topk would pick different
    keys for rows of different lengths (padded prefill, decode steps); topk_keep's earliest-first
    rule picks the same ones on every path, so decoding still equals the full forward."""
    ours = check_loads_transformers_checkpoint(tiny_hf_model(_tiny_hf_config(glm=False)), tmp_path)
    for layer in ours.layers:
        layer.self_attn.indexer.wq_b.weight.zero_()
    check_decode_matches_forward(ours, prompt_lens=(3, 6, 9), new_tokens=4)


def _shipped(name: str):
    from omegaconf import OmegaConf

    from miles.config.schema import ModelCfg

    conf = Path(__file__).resolve().parents[3] / "conf" / "model" / f"{name}.yaml"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(conf)))
    return cfg.arch(cfg.vocab_size)


@pytest.mark.parametrize("name,hf_cls,differ", [
    # transformers' defaults leave out V3.2's YaRN (its config.json has it)
    ("deepseek_v3_2", transformers.DeepseekV32Config, {"rope_scaling"}),
    # GLM-5 defaults keep DeepSeek's bos/eos ids and the default RoPE base (ours: 1e6, from memory)
    ("glm5", transformers.GlmMoeDsaConfig, {"rope_theta", "bos_token_id", "eos_token_id"}),
])
def test_full_size_configs_have_the_dims_of_transformers_defaults(name, hf_cls, differ):
    """transformers' DeepseekV32Config / GlmMoeDsaConfig defaults are the published models' dims
    (their docstrings name deepseek-ai/DeepSeek-V3.2-Exp and zai-org/GLM-5)."""
    import dataclasses

    from miles.models import from_hf_config

    theirs, ours = from_hf_config(hf_cls().to_dict()), _shipped(name)
    mismatched = {f.name for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(theirs, f.name)}
    assert mismatched == differ


def test_family_problems_name_the_field():
    from miles.models import ArchConfig

    arch = _shipped("glm5_tiny")
    with pytest.raises(ValueError, match="q_lora_rank"):
        ArchConfig(**{**vars(arch), "mla": MLAConfig(q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=24,
                                                     qk_rope_head_dim=8, v_head_dim=32)})
    with pytest.raises(ValueError, match="dsa.shared_layers"):
        ArchConfig(**{**vars(arch), "dsa": DSAConfig(index_n_heads=8, rope_interleave=True, shared_layers=[0])})
    with pytest.raises(ValueError, match="dsa.rope_interleave must be false"):
        ArchConfig(**{**vars(arch), "family": "deepseek_v32", "dsa": DSAConfig(rope_interleave=True)})
    with pytest.raises(ValueError, match="clear dsa.shared_layers"):
        ArchConfig(**{**vars(arch), "family": "deepseek_v32", "dsa": DSAConfig(shared_layers=[2])})
