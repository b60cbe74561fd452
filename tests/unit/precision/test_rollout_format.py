"""Weight-sync formats: layout, layer exceptions, inverse equals the trainer's fake quantization, checksums."""

import pytest
import torch

from miles.precision import (
    FP8_DTYPE,
    fake_quant_fp8_weight,
    fake_quant_int4,
    from_rollout_format,
    high_precision_predicate,
    quantized_names,
    rollout_checksum,
    rollout_format,
)


def _weights(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return {
        "model.embed_tokens.weight": r(50, 64),
        "model.layers.0.self_attn.q_proj.weight": r(128, 64),
        "model.layers.0.input_layernorm.weight": r(64),
        "model.layers.1.mlp.gate.weight": r(4, 64),  # MoE router
        "model.layers.1.mlp.experts.gate_up_proj": r(4, 96, 64),  # stacked experts [E, N, K]
        "model.layers.1.mlp.down_proj.weight": r(64, 200),
        "model.layers.2.mlp.up_proj.weight": r(200, 64),
        "model.norm.weight": r(64),
        "lm_head.weight": r(50, 64),
    }


QUANTIZED = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
             "model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.up_proj.weight"]


def test_predicate():
    keep = high_precision_predicate()
    assert keep("model.embed_tokens.weight") and keep("lm_head.weight") and keep("model.norm.weight")
    assert keep("model.layers.3.post_attention_layernorm.weight") and keep("model.layers.1.mlp.gate.weight")
    assert not keep("model.layers.1.mlp.gate_proj.weight") and not keep("model.layers.1.self_attn.o_proj.weight")
    edge = high_precision_predicate(first_n=1, last_n=2, num_layers=10)
    assert edge("model.layers.0.mlp.up_proj.weight") and edge("model.layers.9.mlp.up_proj.weight")
    assert edge("model.layers.8.mlp.up_proj.weight") and not edge("model.layers.7.mlp.up_proj.weight")
    assert not edge("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError):
        high_precision_predicate(last_n=1)


def test_fp8_layout():
    w = _weights()
    fmt = rollout_format(w, "fp8")
    assert list(fmt) == sorted(fmt)
    assert quantized_names(fmt, "fp8") == QUANTIZED
    for name in QUANTIZED:
        assert fmt[name].dtype == FP8_DTYPE and fmt[name].shape == w[name].shape
        assert fmt[name + "_scale_inv"].dtype == torch.float32
    assert fmt["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape == (4, 1, 1)
    assert fmt["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    for name in set(w) - set(QUANTIZED):
        assert torch.equal(fmt[name], w[name])
    assert all(t.is_contiguous() for t in fmt.values())


def test_int4_layout():
    w = _weights()
    fmt = rollout_format(w, "int4", group=32)
    assert list(fmt) == sorted(fmt)
    assert quantized_names(fmt, "int4") == QUANTIZED
    name = "model.layers.1.mlp.down_proj.weight"
    assert fmt[name + "_packed"].shape == (64, 100) and fmt[name + "_packed"].dtype == torch.uint8
    assert fmt[name + "_scale"].shape == (64, 7) and fmt[name + "_shape"].tolist() == [64, 200]
    assert name not in fmt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inverse_equals_the_trainers_fake_quantization(dtype):
    # The sync invariant: what the engine rebuilds == the trainer's forward weights, bit for bit.
    w = _weights(dtype)
    back = from_rollout_format(rollout_format(w, "fp8"), "fp8", dtype=dtype)
    assert list(back) == sorted(w)
    for name in w:
        expect = fake_quant_fp8_weight(w[name]) if name in QUANTIZED else w[name]
        assert back[name].dtype == dtype and torch.equal(back[name], expect), name
    back = from_rollout_format(rollout_format(w, "int4", group=32), "int4", dtype=dtype, group=32)
    assert list(back) == sorted(w)
    for name in w:
        expect = fake_quant_int4(w[name], 32) if name in QUANTIZED else w[name]
        assert back[name].shape == w[name].shape and torch.equal(back[name], expect), name


def test_layer_exceptions_travel_unchanged():
    w = _weights()
    fmt = rollout_format(w, "fp8", keep_high_precision=high_precision_predicate(first_n=1))
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" not in fmt
    assert torch.equal(fmt["model.layers.0.self_attn.q_proj.weight"], w["model.layers.0.self_attn.q_proj.weight"])


def test_none_is_passthrough():
    w = _weights()
    fmt = rollout_format(w, "none")
    assert list(fmt) == sorted(w) and all(torch.equal(fmt[k], w[k]) for k in w)
    assert from_rollout_format(fmt, "none").keys() == fmt.keys()


def test_checksum_is_deterministic_and_sensitive():
    w = _weights()
    a, b = rollout_format(w, "fp8"), rollout_format(dict(reversed(list(w.items()))), "fp8")
    assert rollout_checksum(a) == rollout_checksum(b)  # insertion order does not matter
    assert rollout_checksum(rollout_format(w, "int4")) == rollout_checksum(rollout_format(w, "int4"))
    name = "model.layers.0.self_attn.q_proj.weight"
    flipped = dict(a)
    u = a[name].view(torch.uint8).clone()
    u[0, 0] ^= 1
    flipped[name] = u.view(FP8_DTYPE)
    assert rollout_checksum(flipped) != rollout_checksum(a)


def test_errors():
    with pytest.raises(ValueError, match="unknown rollout format"):
        rollout_format(_weights(), "fp4")
    with pytest.raises(ValueError, match="collide"):
        rollout_format({"a.weight": torch.randn(4, 4), "a.weight_scale_inv": torch.randn(1, 1)}, "fp8")
