"""MLA in the slot decoder on CUDA: graph-captured absorbed decode against eager slot decode, the padded
engine and the full forward, on a DeepSeek-V3-shaped model (the real per-head MLA widths: latent 512,
rope 64, nope 128, v 128; fewer heads and layers).

The dense variant (moe.first_k_dense >= num_layers: no MoE layer) captures CUDA graphs; so do the MoE
tinies (MLA: deepseek_v3, glm4_7_flash; DSA: deepseek_v3_2, glm5), whose experts run the grouped
kernels of miles/models/moe_grouped.py in slot steps. The CPU
tests (tests/unit/rollout/test_mla_slot_decode.py) cover refills, stops, routing and weight updates.
Skipped without a GPU.
"""


import pytest
import torch

from miles.config.schema import DType, ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models.config import MLAConfig, MoEConfig, RopeScalingConfig
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from gpu_runs import max_lp_diff, responses, slot_engines

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DSV3_SHAPED = ModelCfg(
    name="deepseek_v3_shaped", family="deepseek_v3", hidden_size=1024, intermediate_size=2048, num_layers=4,
    num_heads=16, num_kv_heads=16, head_dim=192, max_position_embeddings=256, qk_norm=False,
    mla=MLAConfig(q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    moe=MoEConfig(scoring="sigmoid", score_correction_bias=True, num_shared_experts=1, first_k_dense=4),
    rope_scaling=RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                                   mscale_all_dim=1.0))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(random_checkpoint(DSV3_SHAPED, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("ckpt") / "m"))


@pytest.mark.parametrize("dtype", [DType.fp32, DType.bf16])
def test_mla_graph_decode_equals_eager_slot_decode(checkpoint, dtype):
    graphs, eager, _ = slot_engines(checkpoint, dtype)
    assert graphs.slots.captured and not eager.slots.captured
    a, b = responses(graphs), responses(eager)  # 48 samples over 24 slots: refills and compaction
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert max_lp_diff(a, b) == 0.0  # the same kernels, replayed


def test_mla_slot_decode_matches_the_padded_engine_in_fp32(checkpoint):
    graphs, _, padded = slot_engines(checkpoint, DType.fp32)
    a, b = responses(graphs), responses(padded)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert max_lp_diff(a, b) < 1e-4


def test_mla_graph_decode_logprobs_match_the_full_forward(checkpoint):
    from gpu_runs import full_forward_mismatch

    for dtype, tol in ((DType.fp32, 1e-4), (DType.bf16, 5e-2)):
        graphs, _, _ = slot_engines(checkpoint, dtype)
        mismatch = full_forward_mismatch(responses(graphs, n=2, temperature=1.0), checkpoint, graphs.dtype)
        assert mismatch < tol, (dtype, mismatch)


@pytest.mark.parametrize("model", ["deepseek_v3_tiny", "glm4_7_flash_tiny", "deepseek_v3_2_tiny", "glm5_tiny"])
def test_mla_and_dsa_moe_slot_decode_matches_the_full_forward(compose, tmp_path, model):
    from gpu_runs import full_forward_mismatch

    ckpt = str(random_checkpoint(compose([f"model={model}"]).model, DEFAULT_ALPHABET, seed=0, out=tmp_path / "m"))
    cfg = RolloutCfg(max_new_tokens=24, max_prompt_len=16, max_running=24, sync_every=4)
    for dtype, tol in ((DType.fp32, 1e-4), (DType.bf16, 5e-2)):
        engine = NativeEngine(ckpt, cfg, dtype, device="cuda", seed=0)
        assert engine.slots is not None and engine.slots.captured  # MoE: grouped experts, captured steps
        mismatch = full_forward_mismatch(responses(engine, n=2, temperature=1.0), ckpt, engine.dtype)
        assert mismatch < tol, (dtype, mismatch)


def test_absorbed_equals_expanded_attention_at_the_deepseek_widths():
    from miles.models import CausalLM
    from miles.models.context import slot_mask
    from miles.models.mla_decode import absorbed_attention

    attn = CausalLM(DSV3_SHAPED.arch(64)).layers[0].self_attn.cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        attn.kv_b_proj.weight.normal_(0.0, attn.kv_lora_rank ** -0.5, generator=gen)
    rows, columns = 64, 320
    q = torch.randn(rows, attn.num_heads, 1, attn.qk_dim, device="cuda", generator=gen)
    kv = torch.randn(rows, columns, attn.kv_lora_rank + attn.rope_dim, device="cuda", generator=gen)
    mask = slot_mask(torch.randint(0, columns, (rows,), device="cuda", generator=gen), columns)
    k, v = attn.expand_kv(kv[..., :attn.kv_lora_rank], kv[..., attn.kv_lora_rank:])
    reference = attn.attend(q, k, v, mask)
    with torch.no_grad():
        fp32 = absorbed_attention(q, kv, mask, attn.kv_b_proj.weight, attn.nope_dim, attn.scale)
        bf16 = absorbed_attention(q.bfloat16(), kv.bfloat16(), mask, attn.kv_b_proj.weight.bfloat16(), attn.nope_dim,
                                  attn.scale)
    scale = reference.abs().max().item()
    assert (fp32 - reference).abs().max().item() <= 1e-4 * scale  # TF32 off by default: fp32 GEMMs
    assert (bf16.float() - reference).abs().max().item() <= 2e-2 * scale
