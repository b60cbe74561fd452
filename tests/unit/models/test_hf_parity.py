"""Parity of miles.models with `transformers` Qwen3 / Qwen2, both checkpoint directions.

Tolerance: logits are compared in float32 with max |diff| < 1e-5. Both implementations
compute the same float32 math in a slightly different op order, so differences are at
rounding level (~1e-7 for these tiny models); a wrong weight mapping, RoPE layout or
norm placement gives differences of order 1e-2 or more.

All weights are randomized (including norms and biases, which HF initializes to 1 / 0)
so that a swapped or dropped tensor changes the logits.
"""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from miles.models import ArchConfig, CausalLM, from_hf_config, from_pretrained, save_pretrained

ATOL = 1e-5
VOCAB = 64


def _hf_config(model_type: str, tied: bool, head_dim):
    cls = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config}[model_type]
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    return cls(**kwargs)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 else 0.0))


def _tiny_hf(model_type: str, tied: bool, head_dim=None, seed: int = 0):
    torch.manual_seed(seed)
    cfg = _hf_config(model_type, tied, head_dim)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _randomize(model, seed)
    return model


def _ids(batch=2, length=9, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


HF_VARIANTS = [
    ("qwen3", False, 16),  # head_dim != hidden / heads (32 / 4 = 8), which Qwen3 allows
    ("qwen3", True, 16),
    ("qwen3", False, 8),
    ("qwen2", False, None),  # Qwen2 has no head_dim in config.json: hidden / heads
    ("qwen2", True, None),
]


@pytest.mark.parametrize("model_type,tied,head_dim", HF_VARIANTS)
def test_load_transformers_checkpoint_matches_logits(tmp_path, model_type, tied, head_dim):
    hf = _tiny_hf(model_type, tied, head_dim)
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)

    assert ours.config.qk_norm == (model_type == "qwen3")
    assert ours.config.attention_bias == (model_type == "qwen2")
    assert ours.config.head_dim == (head_dim or 8)
    assert (ours.lm_head is None) == tied
    ids = _ids()
    with torch.no_grad():
        assert _max_diff(ours(ids), hf(ids).logits) < ATOL


@pytest.mark.parametrize("model_type,tied,head_dim", HF_VARIANTS)
def test_transformers_loads_our_checkpoint(tmp_path, model_type, tied, head_dim):
    cfg = from_hf_config(_hf_config(model_type, tied, head_dim).to_dict())
    ours = CausalLM(cfg, seed=3).eval()
    _randomize(ours, seed=3)
    save_pretrained(ours, tmp_path)

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    # transformers would silently randomly initialize anything it did not find.
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert type(hf).__name__ == {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    ids = _ids(seed=5)
    with torch.no_grad():
        assert _max_diff(ours(ids), hf.eval()(ids).logits) < ATOL


@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip_is_bitwise(tmp_path, tied):
    cfg = ArchConfig(VOCAB, 32, 64, 2, 4, 2, 16, tie_word_embeddings=tied, eos_token_id=3)
    ours = CausalLM(cfg, seed=7)
    _randomize(ours, seed=7)
    save_pretrained(ours, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not tied)  # a tied head is stored once

    loaded = from_pretrained(tmp_path)
    assert loaded.config == cfg
    a, b = ours.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_save_in_bfloat16_and_load_as_float32(tmp_path):
    ours = CausalLM(ArchConfig(VOCAB, 32, 64, 1, 4, 2, 8), seed=0)
    save_pretrained(ours, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_file(tmp_path / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    loaded = from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.dtype == torch.float32
    expected = ours.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(loaded.embed_tokens.weight, expected)


def test_sharded_checkpoint_loads(tmp_path):
    hf = _tiny_hf("qwen3", tied=False, head_dim=16)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").exists()

    ours = from_pretrained(tmp_path)
    ids = _ids()
    with torch.no_grad():
        assert _max_diff(ours(ids), hf(ids).logits) < ATOL


def _save_tiny(tmp_path) -> None:
    save_pretrained(CausalLM(ArchConfig(VOCAB, 32, 64, 2, 4, 2, 8), seed=0), tmp_path)


def test_missing_tensor_is_named(tmp_path):
    _save_tiny(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: \['model\.layers\.1\.self_attn\.k_norm\.weight'\]"):
        from_pretrained(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    _save_tiny(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensors: \['model\.layers\.0\.self_attn\.o_proj\.bias'\]"):
        from_pretrained(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    _save_tiny(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        from_pretrained(tmp_path)


def test_unsupported_model_type_is_named(tmp_path):
    _save_tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'llama'"):
        from_pretrained(tmp_path)


LEGACY_CONFIG = {  # transformers < 5 style: top-level rope_theta, no head_dim
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 7,
}


def test_from_hf_config_reads_legacy_dicts():
    qwen2 = from_hf_config({**LEGACY_CONFIG, "model_type": "qwen2"})
    assert (qwen2.qk_norm, qwen2.attention_bias, qwen2.head_dim) == (False, True, 8)
    assert (qwen2.rope_theta, qwen2.num_layers, qwen2.num_kv_heads) == (1e6, 3, 2)
    assert qwen2.tie_word_embeddings and qwen2.eos_token_id == 7
    qwen3 = from_hf_config({**LEGACY_CONFIG, "model_type": "qwen3"})
    # Follows transformers: a Qwen3 config.json without head_dim means 128.
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.head_dim) == (True, False, 128)


def test_unsupported_rope_scaling_raises():
    with pytest.raises(ValueError, match="'yarn'"):
        from_hf_config({**LEGACY_CONFIG, "model_type": "qwen3", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
