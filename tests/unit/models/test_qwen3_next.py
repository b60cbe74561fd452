"""Qwen3-Next: module parity of gated DeltaNet and gated attention with transformers, the shared zoo
checks on tiny Qwen3NextConfig models (dense and MoE), MTP tensors skipped, config conversion.

fp32 tolerance of the decode check: a randomized tiny Qwen3-Next (zoo_checks.randomize: norm weights
around 1, i.e. zero-centered scales around 2; softmax routing) amplifies float32 rounding. Measured
against a float64 evaluation of the same weights, transformers' own fp32 logits are ~1.6e-5 off
(dense) and ~5e-5 off (MoE), ours the same; prefill + decode reorders the recurrence's sums (one
chunk of T vs T chunks of 1), so two fp32 evaluations agree only to ~1e-4. The decode check runs
again in float64, where decode must equal the full forward to 1e-9: that is the exactness proof.
"""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from miles.models import from_pretrained
from miles.models.config import from_hf_config
from miles.models.context import ForwardContext
from miles.models.deltanet import GatedAttention, GatedDeltaNet, gated_delta_rule
from zoo_checks import (check_decode_matches_forward, check_loads_transformers_checkpoint,
                        check_transformers_loads_ours, max_diff, randomize, tiny_hf_model)

LOAD_ATOL_FP32 = 5e-5  # logits vs transformers (measured 1.6e-5 on AVX2, under 1e-5 on AVX-512)
DECODE_ATOL_FP32 = 3e-4  # see the module docstring (measured worst case 1.2e-4)


def tiny_config(num_experts: int = 0, **kw) -> transformers.Qwen3NextConfig:
    """4 layers (3 DeltaNet + 1 gated attention), 2 key heads serving 4 value heads, Dk != Dv."""
    cfg = transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, num_experts=num_experts, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, **kw)
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
@pytest.mark.parametrize("t", [1, 7, 64, 130])  # one token, one chunk, exactly one chunk, three chunks
def test_gated_deltanet_matches_transformers(t):
    cfg = tiny_config()
    hf = hf_next.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    randomize(hf, seed=3)
    ours = GatedDeltaNet(from_hf_config(cfg.to_dict()), 0)
    ours.load_state_dict(hf.state_dict())  # same names and shapes
    x = torch.randn(2, t, 32, generator=torch.Generator().manual_seed(t))
    ctx = ForwardContext(torch.arange(t).expand(2, t), None, 0)
    diff = max_diff(ours(x, ctx), hf(x))
    assert diff < 1e-5, diff


@torch.no_grad()
def test_gated_attention_matches_transformers():
    cfg = tiny_config()
    hf = hf_next.Qwen3NextAttention(cfg, 3).eval()
    randomize(hf, seed=4)
    ours = GatedAttention(from_hf_config(cfg.to_dict()), 3)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    cos_sin = hf_next.Qwen3NextRotaryEmbedding(cfg)(x, pos)
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    diff = max_diff(ours(x, ForwardContext(pos, None, 0)), hf(x, cos_sin, causal)[0])
    assert diff < 1e-5, diff


def test_chunked_delta_rule_equals_the_token_loop():
    """The chunked solve is the recurrence S_t = e^g S + k (beta (v - e^g S^T k))^T, o_t = S_t^T q_t,
    from a nonzero initial state, across chunk boundaries (float64: exact up to rounding)."""
    gen = torch.Generator().manual_seed(0)
    b, h, t, dk, dv = 2, 3, 11, 4, 5
    q, k = (torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(b, h, t, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(b, h, t, generator=gen, dtype=torch.float64)
    beta = torch.rand(b, h, t, generator=gen, dtype=torch.float64)
    s0 = torch.randn(b, h, dk, dv, generator=gen, dtype=torch.float64)
    out, state = gated_delta_rule(q, k, v, g, beta, s0.clone(), chunk=4)
    s, ref = s0, []
    for i in range(t):
        s = s * g[:, :, i].exp()[..., None, None]
        delta = beta[:, :, i, None] * (v[:, :, i] - (s * k[:, :, i, :, None]).sum(-2))
        s = s + k[:, :, i, :, None] * delta[..., None, :]
        ref.append((s * q[:, :, i, :, None]).sum(-2))
    assert max_diff(out, torch.stack(ref, 2)) < 1e-12 and max_diff(state, s) < 1e-12


@pytest.mark.parametrize("num_experts", [0, 8], ids=["dense", "moe"])
def test_qwen3_next_passes_the_zoo_checks(tmp_path, num_experts):
    """num_experts 0: dense MLPs (transformers allows it); 8: top-2 MoE + sigmoid-gated shared expert,
    with layer 1 a dense mlp_only layer."""
    cfg = tiny_config(num_experts, mlp_only_layers=[1] if num_experts else None)
    # transformers' chunked delta rule sums in another order than ours: 1.6e-5 apart on an AVX2 CPU
    ours = check_loads_transformers_checkpoint(tiny_hf_model(cfg), tmp_path, atol=LOAD_ATOL_FP32)
    assert type(ours.layers[0].linear_attn).__name__ == "GatedDeltaNet"
    assert type(ours.layers[3].self_attn).__name__ == "GatedAttention"
    assert type(ours.norm).__name__ == "ZeroCenteredRMSNorm"
    check_transformers_loads_ours(ours, tmp_path, atol=LOAD_ATOL_FP32)
    check_decode_matches_forward(ours, atol=DECODE_ATOL_FP32)
    check_decode_matches_forward(ours.double(), atol=1e-9)


@torch.no_grad()
def test_left_padded_batch_matches_transformers(tmp_path):
    """Pad positions are zeroed before the DeltaNet and leave its state alone: a left-padded batch
    gives transformers' logits at every real position."""
    hf = tiny_hf_model(tiny_config())
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    diff = max_diff(ours(ids, attention_mask=mask, position_ids=pos)[mask.bool()],
                    hf(ids, attention_mask=mask, position_ids=pos).logits[mask.bool()])
    assert diff < 1e-5, diff


def test_mtp_tensors_in_a_checkpoint_are_skipped(tmp_path):
    hf = tiny_hf_model(tiny_config())
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(32, 64)  # what real Qwen3-Next checkpoints carry
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = from_pretrained(tmp_path)
    assert not any(name.startswith("mtp") for name in ours.state_dict())


def test_real_config_json_converts_and_round_trips():
    """config.json of Qwen/Qwen3-Next-80B-A3B-Instruct (transformers 4.57 spelling: partial_rotary_factor
    and full_attention_interval at the top level, no layer_types)."""
    d = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
         "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
         "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
         "rope_scaling": None, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
         "linear_num_value_heads": 32, "decoder_sparse_step": 1, "moe_intermediate_size": 512,
         "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512,
         "norm_topk_prob": True, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
         "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645}
    arch = from_hf_config(d)
    assert arch.rotary_dim == 64 and arch.rope_theta == 1e7
    assert [arch.linear_attn.is_linear_layer(i) for i in range(4)] == [True, True, True, False]
    assert (arch.moe.num_experts, arch.moe.num_experts_per_tok, arch.moe.shared_expert_intermediate_size) == (512, 10, 512)
    back = json.loads(json.dumps(arch.to_hf_config()))
    assert from_hf_config(back) == arch
    # transformers reads our config.json as the same architecture
    hf_cfg = transformers.Qwen3NextConfig(**{k: v for k, v in back.items() if k not in ("architectures", "model_type")})
    assert hf_cfg.layer_types == back["layer_types"]
    assert hf_cfg.rope_parameters["partial_rotary_factor"] == 0.25


def test_irregular_layer_types_are_refused():
    d = tiny_config().to_dict()
    d["layer_types"] = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        from_hf_config(d)
