"""Llama 4 through the shared zoo checks (see zoo_checks.py), plus its own pieces: chunked attention
that follows token positions under left padding, the published multimodal checkpoint layout,
llama3 RoPE scaling and MoE routing record / replay.

The tiny config keeps every Llama 4 feature active at a 9-11 token length: attention chunks of 4
tokens (so chunking cuts the sequence), a NoPE layer with temperature tuning whose floor_scale is
2 (so the query scale changes within the sequence), L2 qk-norm, llama3 RoPE scaling with an
original context of 8 (so frequencies are actually rescaled), MoE layers interleaved with dense
ones, and a shared expert.
"""

import json

import pytest
import torch
import transformers

from miles.models import ArchConfig, CausalLM, from_hf_config, from_pretrained
from miles.models.config import Llama4AttnConfig, MoEConfig, RopeScalingConfig
from miles.models.context import causal_mask
from zoo_checks import (check_decode_matches_forward, check_loads_transformers_checkpoint,
                        check_transformers_loads_ours, max_diff, random_ids, randomize, tiny_hf_model)

ATOL = 1e-5


def _text_config(**over) -> transformers.Llama4TextConfig:
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=48,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
              no_rope_layer_interval=3, attention_chunk_size=4, use_qk_norm=True,
              attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8},
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(over)
    return transformers.Llama4TextConfig(**kw)


def test_tiny_config_exercises_every_feature():
    arch = from_hf_config(_text_config().to_dict())
    assert arch.family == "llama4_text" and arch.llama4.attention_chunk_size == 4
    # layers: 0 RoPE+dense, 1 RoPE+MoE, 2 NoPE+dense, 3 RoPE+MoE
    assert [arch.llama4.uses_rope(i) for i in range(4)] == [True, True, False, True]
    assert [arch.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert arch.intermediate_size == 48 and arch.moe.moe_intermediate_size == 32
    assert arch.rope_scaling.type == "llama3"


def test_llama4_passes_the_zoo_checks(tmp_path):
    ours = check_loads_transformers_checkpoint(tiny_hf_model(_text_config()), tmp_path)
    check_transformers_loads_ours(ours, tmp_path)
    check_decode_matches_forward(ours)


def test_llama4_top2_plain_rope_no_qk_norm(tmp_path):
    """Maverick-like variants: no qk-norm, no RoPE scaling, no temperature tuning; and top-2
    routing (HF scales each chosen expert's input by its own sigmoid score)."""
    cfg = _text_config(num_experts_per_tok=2, use_qk_norm=False, attn_temperature_tuning=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, interleave_moe_layer_step=1)
    ours = check_loads_transformers_checkpoint(tiny_hf_model(cfg, seed=3), tmp_path)
    check_transformers_loads_ours(ours, tmp_path)
    check_decode_matches_forward(ours)


@torch.no_grad()
def test_left_padded_batch_matches_transformers_chunking():
    """transformers offsets chunks by each row's left padding: our padded forward equals theirs
    on real tokens, and both equal the unpadded forward. Temperature tuning is off here because
    transformers takes its positions from the padded columns (arange + cache length) rather than
    position_ids, so its padded rows differ from its own unpadded forward on NoPE layers; ours use
    the tokens' positions (checked against the unpadded forward in the zoo decode check)."""
    hf = tiny_hf_model(_text_config(attn_temperature_tuning=False))
    ours = CausalLM(from_hf_config(hf.config.to_dict()))
    ours.load_state_dict({k: v for k, v in _our_state(hf).items()}, strict=True)
    ids = random_ids(64, batch=2, length=11, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0: 6 real tokens after 5 pads
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    mine = ours(ids, attention_mask=mask, position_ids=pos)
    theirs = hf(ids, attention_mask=mask, position_ids=pos).logits
    assert max_diff(mine[0, 5:], theirs[0, 5:]) < ATOL
    assert max_diff(mine[1], theirs[1]) < ATOL
    assert max_diff(mine[0, 5:], ours(ids[:1, 5:])[0]) < ATOL


def _our_state(hf) -> dict:
    from miles.models.families import get_family

    family = get_family("llama4_text")
    return {family.from_hf_name(k): v for k, v in hf.state_dict().items()}


def test_chunk_mask_follows_token_positions():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])  # token positions 0..4 at columns 2..6
    allowed = causal_mask(mask, past=0, t=7, device=torch.device("cpu"), chunk=2)[0, 0]
    # token 2 (column 4) starts a new chunk: it sees itself only; token 3 (column 5) sees 2 and 3
    assert allowed[4, 2:].tolist() == [False, False, True, False, False]
    assert allowed[5, 2:].tolist() == [False, False, True, True, False]
    # decode step: one query at column 7 = token 5 (chunk 2..3 -> tokens 4, 5)
    step = causal_mask(torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1), past=7, t=1,
                       device=torch.device("cpu"), chunk=2)[0, 0, 0]
    assert step.tolist() == [False] * 6 + [True, True]


@torch.no_grad()
def test_published_multimodal_checkpoint_loads_text_model(tmp_path):
    """A Llama4ForConditionalGeneration directory (as meta-llama/Llama-4-Scout-17B-16E): nested
    text_config, `language_model.*` tensors, vision tower ignored; our logits equal HF's on text."""
    vision = transformers.Llama4VisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, image_size=28, patch_size=14,
                                             vision_output_dim=16, projector_input_dim=16,
                                             projector_output_dim=16, pixel_shuffle_ratio=0.5)
    cfg = transformers.Llama4Config(text_config=_text_config().to_dict(), vision_config=vision.to_dict())
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Llama4ForConditionalGeneration(cfg).eval()
    randomize(hf, seed=7)
    hf.save_pretrained(tmp_path / "mm")
    saved = json.loads((tmp_path / "mm" / "config.json").read_text())
    assert saved["model_type"] == "llama4" and "text_config" in saved
    ours = from_pretrained(tmp_path / "mm")
    assert ours.config.family == "llama4_text"
    ids = random_ids(64, length=11)
    # Without images the multimodal forward is exactly its language model; transformers 5.24's
    # Llama4ForConditionalGeneration.forward itself fails on text-only input (it reads
    # `image_outputs` from an output type that has none), so call the language model directly.
    diff = max_diff(ours(ids), hf.language_model(input_ids=ids).logits)
    assert diff < ATOL, diff
    # saving writes the text-only Llama4ForCausalLM that transformers loads
    check_transformers_loads_ours(ours, tmp_path)


def test_family_rejects_what_it_cannot_express():
    base = dict(family="llama4_text", vocab_size=64, qk_norm=False, llama4=Llama4AttnConfig(),
                moe=MoEConfig(scoring="sigmoid", norm_topk_prob=False, num_shared_experts=1))
    ArchConfig(**base)
    with pytest.raises(ValueError, match="qk_norm"):
        ArchConfig(**{**base, "qk_norm": True})
    with pytest.raises(ValueError, match="scoring: sigmoid"):
        ArchConfig(**{**base, "moe": MoEConfig(num_shared_experts=1)})
    with pytest.raises(ValueError, match="llama3"):
        ArchConfig(**{**base, "rope_scaling": RopeScalingConfig(type="yarn")})
    with pytest.raises(ValueError, match="multimodal"):
        ArchConfig(**{**base, "family": "llama4"})


def test_routing_record_and_replay():
    hf = tiny_hf_model(_text_config())
    model = CausalLM(from_hf_config(hf.config.to_dict()))
    model.load_state_dict(_our_state(hf))
    ids = random_ids(64, length=11)
    record = {}
    logits = model(ids, routing_record=record)
    assert sorted(record) == [1, 3] and record[1].shape == (2, 11, 1)
    assert torch.equal(model(ids, routing_replay=record), logits)
    forced = {k: (v + 1) % 4 for k, v in record.items()}
    assert not torch.allclose(model(ids, routing_replay=forced), logits)


def test_llama3_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from miles.models.rope import inv_freq

    for low, high in ((1.0, 4.0), (1.0, 1.0)):  # (1, 1): Scout's published values
        cfg = _text_config(head_dim=128, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": 8192})
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
        got, factor = inv_freq(128, 500000.0, from_hf_config(cfg.to_dict()).rope_scaling)
        assert factor == 1.0 and torch.equal(got, want)


def test_autocast_trains_through_router_and_experts():
    """fp32 weights under bf16 autocast (the trainer's mixed precision): forward and backward run,
    and the router gets a gradient through the sigmoid weight that scales the expert input."""
    model = CausalLM(from_hf_config(_text_config().to_dict()), seed=0)
    ids = random_ids(64, length=11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids).float().logsumexp(-1).mean().backward()
    moe = model.layers[1].mlp
    assert moe.router.weight.grad.abs().sum() > 0 and moe.experts.gate_up_proj.grad.abs().sum() > 0
