"""The Megatron-core backend's pure parts on the CPU (no megatron import): ArchConfig -> TransformerConfig /
GPTModel arguments, and native <-> GPTModel weights. The real GPTModel is tested on the GPU
(tests/gpu/test_megatron_cuda.py): its state-dict names and shapes, its forward, a training step."""

import re

import pytest
import torch

from miles.models import CausalLM
from miles.models.config import ArchConfig, MoEConfig
from miles.trainer.megatron.arch import megatron_spec, moe_layer_pattern, problems
from miles.trainer.megatron.specs import gpt_model_kwargs
from miles.trainer.megatron.weights import from_megatron, to_megatron

@pytest.fixture
def arch_of(compose):
    """arch_of(name, vocab) -> the ArchConfig of conf/model/<name>.yaml, through the config schema."""
    return lambda name, vocab=50: compose([f"model={name}"]).model.arch(vocab)


def test_qwen3_0_6b_translates_to_its_published_megatron_config(arch_of):
    spec = megatron_spec(arch_of("qwen3_0_6b", 151936), bf16=True)
    t, m = spec.transformer, spec.model
    assert (t["num_layers"], t["hidden_size"], t["ffn_hidden_size"]) == (28, 1024, 3072)
    assert (t["num_attention_heads"], t["num_query_groups"], t["kv_channels"]) == (16, 8, 128)
    assert t["qk_layernorm"] and not t["add_qkv_bias"] and not t["add_bias_linear"]
    assert (t["normalization"], t["layernorm_epsilon"], t["gated_linear_unit"]) == ("RMSNorm", 1e-6, True)
    assert (t["bf16"], t["params_dtype"]) == (True, "bfloat16")
    assert "num_moe_experts" not in t and spec.moe_layers == []
    assert m == dict(vocab_size=151936, max_sequence_length=40960, position_embedding_type="rope",
                     rotary_base=1000000.0, rotary_percent=1.0, share_embeddings_and_output_weights=True,
                     parallel_output=True)
    assert spec.activation == "silu" and spec.layer_spec == {"normalization": "RMSNorm", "rope_theta": 1000000.0}
    # the local spec's core attention applies RoPE (miles/trainer/megatron/specs.py); TE's spec keeps GPTModel's
    assert gpt_model_kwargs(m, te=False, layer_spec=spec.layer_spec) == {**m, "position_embedding_type": "none"}
    assert gpt_model_kwargs(m, te=True, layer_spec=spec.layer_spec) == m


def test_qwen2_has_qkv_bias_and_no_qk_norm_and_fp32_and_recompute(arch_of):
    t = megatron_spec(arch_of("qwen2_5_tiny"), bf16=False, recompute=True).transformer
    assert t["add_qkv_bias"] and not t["qk_layernorm"]
    assert (t["bf16"], t["params_dtype"]) == (False, "float32")
    assert (t["recompute_granularity"], t["recompute_method"], t["recompute_num_layers"]) == ("full", "uniform", 1)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_router_maps_to_softmax_top_k(norm_topk_prob, arch_of):
    arch = arch_of("qwen3_moe_tiny")
    arch.moe.norm_topk_prob = norm_topk_prob
    t = megatron_spec(arch, bf16=True).transformer
    assert (t["num_moe_experts"], t["moe_router_topk"], t["moe_ffn_hidden_size"]) == (8, 2, 32)
    assert t["moe_router_score_function"] == "softmax"
    # softmax of the k largest logits == the full softmax's top k renormalized; no renormalization:
    # the full softmax first.
    assert t["moe_router_pre_softmax"] is (not norm_topk_prob)
    assert t["moe_layer_freq"] == [1, 1, 1] and t["moe_router_load_balancing_type"] == "none"


def test_dense_layers_inside_a_moe_model():
    arch = ArchConfig(vocab_size=50, num_layers=4, family="qwen3_moe", moe=MoEConfig(num_experts=4),
                      mlp_only_layers=[1])
    assert moe_layer_pattern(arch) == [1, 0, 1, 1]
    assert megatron_spec(arch, bf16=True).moe_layers == [0, 2, 3]


@pytest.mark.parametrize("name, message", [
    ("qwen3_next_tiny", "qwen3_next is not mapped yet (its gated DeltaNet"),
    ("glm4_moe_tiny", "glm4_moe is not mapped yet"),
    ("llama4_tiny", "llama4_text is not mapped yet"),
])
def test_unmapped_families_are_named(name, message, arch_of):
    assert any(message in p for p in problems(arch_of(name)))
    with pytest.raises(ValueError, match=re.escape(message)):
        megatron_spec(arch_of(name), bf16=True)


def test_deepseek_v3_translates_to_mla_and_the_deepseek_router(arch_of):
    """The published DeepSeek-V3 sizes (conf/model/deepseek_v3.yaml) as MLATransformerConfig fields."""
    arch = arch_of("deepseek_v3")
    arch.mtp_layers = 0
    spec = megatron_spec(arch, bf16=True)
    t = spec.transformer
    assert spec.config_class == "MLATransformerConfig" and t["multi_latent_attention"] and t["qk_layernorm"]
    assert (t["q_lora_rank"], t["kv_lora_rank"], t["qk_head_dim"], t["qk_pos_emb_head_dim"], t["v_head_dim"]) == (
        1536, 512, 128, 64, 128)
    assert (t["rope_type"], t["rotary_base"], t["rotary_scaling_factor"], t["original_max_position_embeddings"]) == (
        "yarn", 10000.0, 40.0, 4096)
    assert (t["beta_fast"], t["beta_slow"], t["mscale"], t["mscale_all_dim"]) == (32.0, 1.0, 1.0, 1.0)
    assert (t["num_moe_experts"], t["moe_router_topk"], t["moe_ffn_hidden_size"]) == (256, 8, 2048)
    assert (t["moe_router_score_function"], t["moe_router_enable_expert_bias"], t["moe_router_bias_update_rate"]) == (
        "sigmoid", True, 0.0)
    assert (t["moe_router_num_groups"], t["moe_router_group_topk"], t["moe_router_topk_scaling_factor"]) == (8, 4, 2.5)
    assert t["moe_shared_expert_intermediate_size"] == 2048
    assert t["moe_layer_freq"] == [0, 0, 0] + [1] * 58 and spec.moe_layers == list(range(3, 61))
    # the latent norms' eps of DeepSeek's checkpoints, whatever rms_norm_eps says (specs.py applies it)
    assert spec.layer_spec == {"normalization": "RMSNorm", "latent_norm_eps": 1e-6}


@pytest.mark.parametrize("name", ["deepseek_v3_tiny", "deepseek_v3", "deepseek_r1", "kimi_k2", "kimi_k2_thinking",
                                  "kimi_k2_5", "glm4_7_flash_tiny", "glm4_7_flash", "deepseek_v3_2_tiny",
                                  "deepseek_v3_2", "glm5_tiny", "glm5"])
def test_mla_family_checkpoints_are_mapped(name, arch_of):
    arch = arch_of(name)
    arch.mtp_layers = 0  # DeepSeek-V3 / R1 ship an MTP layer: refused below
    assert problems(arch) == []


def test_what_mla_does_not_map_is_named(arch_of):
    cases = [("mtp_layers", 1, "set model.mtp_layers=0"),
             ("attention_bias", True, "projections with biases")]
    for field, value, message in cases:
        arch = arch_of("deepseek_v3_tiny")
        setattr(arch, field, value)
        assert any(message in p for p in problems(arch)), (field, problems(arch))
    arch = arch_of("deepseek_v3_tiny")
    arch.mla.rope_interleave, arch.moe.norm_topk_prob, arch.rope_scaling.truncate = False, False, False
    assert [p.split(": ")[1][:30] for p in problems(arch)] == [
        "megatron-core's MLA rotates ad", "MLA maps YaRN with truncate=tr", "megatron-core renormalizes sig"]


def _qkv_labelled(arch: ArchConfig) -> dict[str, torch.Tensor]:
    """q / k / v rows whose value says where they come from: 1000 * kind + row (kind 1 q, 2 k, 3 v)."""
    h, g, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    rows = lambda kind, n: (1000 * kind + torch.arange(n, dtype=torch.float32))[:, None].expand(n, 3)  # noqa: E731
    return {"q": rows(1, h * d), "k": rows(2, g * d), "v": rows(3, g * d)}


def test_qkv_rows_are_grouped_per_query_group():
    """4 heads, 2 groups, head_dim 2: group 0 = q heads 0-1, k 0, v 0; then group 1 = q heads 2-3, k 1, v 1."""
    arch = ArchConfig(vocab_size=10, num_layers=1, hidden_size=3, num_heads=4, num_kv_heads=2, head_dim=2,
                      intermediate_size=4)
    state = CausalLM(arch).state_dict()
    labelled = _qkv_labelled(arch)
    for kind in "qkv":
        state[f"layers.0.self_attn.{kind}_proj.weight"] = labelled[kind]
    fused = to_megatron(state, arch)["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist()
    assert fused == [1000, 1001, 1002, 1003, 2000, 2001, 3000, 3001,
                     1004, 1005, 1006, 1007, 2002, 2003, 3002, 3003]


def test_mlp_and_expert_layouts():
    arch = ArchConfig(vocab_size=10, num_layers=2, family="qwen3_moe", moe=MoEConfig(num_experts=3),
                      mlp_only_layers=[1])
    state = CausalLM(arch, seed=0).state_dict()
    out = to_megatron(state, arch)
    # dense layer 1: [gate; up] rows
    assert torch.equal(out["decoder.layers.1.mlp.linear_fc1.weight"],
                       torch.cat([state["layers.1.mlp.gate_proj.weight"], state["layers.1.mlp.up_proj.weight"]]))
    # MoE layer 0: expert e's fc1 is its slice of the fused gate_up [E, 2I, H] (gate rows, then up)
    for e in range(3):
        assert torch.equal(out[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"],
                           state["layers.0.mlp.experts.gate_up_proj"][e])
        assert torch.equal(out[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2.weight"],
                           state["layers.0.mlp.experts.down_proj"][e])
    assert torch.equal(out["decoder.layers.0.mlp.router.weight"], state["layers.0.mlp.gate.weight"])


@pytest.mark.parametrize("te", [False, True])
@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen2_5_tiny", "qwen3_moe_tiny", "qwen3_0_6b", "deepseek_v3_tiny",
                                  "deepseek_v3_tiny_q_proj", "glm4_7_flash_tiny", "deepseek_v3_2_tiny", "glm5_tiny"])
def test_round_trip_is_bitwise(name, te, arch_of):
    arch = arch_of(name.removesuffix("_q_proj"))
    if name == "qwen3_0_6b":  # the published dims at two layers (the mapping is per layer)
        arch.num_layers = 2
    if name.endswith("_q_proj"):  # no q compression (DeepSeek-V2-Lite's layout): one q_proj
        arch.mla.q_lora_rank = 0
    state = CausalLM(arch, seed=0).state_dict()
    mstate = to_megatron(state, arch, te=te)
    assert ("output_layer.weight" in mstate) is (not arch.tie_word_embeddings)
    fused = te and arch.mla is None  # TE's MLA spec keeps the input norm apart
    norm = "self_attention.linear_qkv.layer_norm_weight" if fused else "input_layernorm.weight"
    assert f"decoder.layers.0.{norm}" in mstate
    mstate["decoder.layers.0.self_attention.linear_proj._extra_state"] = None  # Megatron's bookkeeping
    back = from_megatron(mstate, arch, te=te)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("te", [False, True])
def test_mla_and_deepseek_moe_names(te, arch_of):
    """MLA's projections are renamed as they are (HF's row layouts are Megatron's); the shared expert's
    fc1 is [gate; up]; the correction bias is the router's expert_bias; TE fuses the latent norms."""
    arch = arch_of("deepseek_v3_tiny")
    state = CausalLM(arch, seed=0).state_dict()
    out = to_megatron(state, arch, te=te)
    n, m = "layers.1.", "decoder.layers.1."
    for native, mega in [("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight"),
                         ("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight"),
                         ("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight"),
                         ("self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight"),
                         ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
                         ("self_attn.q_a_layernorm.weight",
                          "self_attention." + ("linear_q_up_proj.layer_norm_weight" if te else "q_layernorm.weight")),
                         ("self_attn.kv_a_layernorm.weight",
                          "self_attention." + ("linear_kv_up_proj.layer_norm_weight" if te else "kv_layernorm.weight")),
                         ("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias"),
                         ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight")]:
        assert torch.equal(out[m + mega], state[n + native]), native
    assert torch.equal(out[m + "mlp.shared_experts.linear_fc1.weight"],
                       torch.cat([state[n + "mlp.shared_experts.gate_proj.weight"],
                                  state[n + "mlp.shared_experts.up_proj.weight"]]))
    assert ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in out) is te  # the dense first layer


@pytest.mark.parametrize("name", ["deepseek_v3_2_tiny", "glm5_tiny"])
def test_dsa_indexers_go_into_the_core_attention(name, arch_of):
    """DSA: each layer's indexer (wq_b, wk, k_norm with its bias, weights_proj) under the project's core
    attention, names unchanged; GLM-5's sharing layer has none. The spec hands the ArchConfig to that
    core attention (specs.py), as MLA's."""
    arch = arch_of(name)
    spec = megatron_spec(arch, bf16=True)
    assert spec.config_class == "MLATransformerConfig" and spec.layer_spec["dsa"] is arch
    state = CausalLM(arch, seed=0).state_dict()
    out = to_megatron(state, arch)
    parts = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
    for i in range(arch.num_layers):
        for part in parts:
            native = f"layers.{i}.self_attn.indexer.{part}"
            mega = f"decoder.layers.{i}.self_attention.core_attention.indexer.{part}"
            assert (native in state) is (mega in out) is (i not in arch.dsa.shared_layers), (i, part)
            if native in state:
                assert torch.equal(out[mega], state[native])
    assert sum(".indexer." in k for k in out) == 5 * (arch.num_layers - len(arch.dsa.shared_layers))


def test_dsa_without_q_compression_is_named(arch_of):
    arch = arch_of("deepseek_v3_2_tiny")
    arch.mla.q_lora_rank = 0
    assert problems(arch) == ["trainer=megatron: DSA's indexer reads the q latent (mla.q_lora_rank > 0)"]


def test_te_names_fuse_the_dense_pre_mlp_norm_only():
    arch = ArchConfig(vocab_size=10, num_layers=2, family="qwen3_moe", moe=MoEConfig(num_experts=2),
                      mlp_only_layers=[1])
    out = to_megatron(CausalLM(arch).state_dict(), arch, te=True)
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in out  # dense: fused into fc1
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in out  # MoE: the router needs it apart


def test_unknown_tensors_are_refused_by_name(arch_of):
    arch = arch_of("qwen3_tiny")
    state = CausalLM(arch).state_dict()
    with pytest.raises(KeyError, match="layers.0.mlp.extra.weight"):
        to_megatron({**state, "layers.0.mlp.extra.weight": torch.zeros(1)}, arch)
    mstate = to_megatron(state, arch)
    with pytest.raises(KeyError, match="decoder.layers.0.mystery"):
        from_megatron({**mstate, "decoder.layers.0.mystery": torch.zeros(1)}, arch)
