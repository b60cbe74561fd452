"""The weight-absorbed MLA decode (miles/models/mla_decode.py) against MLA's expanded attention (DSA too).

On random inputs: equal within fp32 rounding, and in bf16 as close to the fp32 result as the expanded
bf16 attention is. Through the model: a slot cache whose rows have different lengths decodes one step
equal to the full forward, on the absorbed path; a weight update reaches the next step.
"""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from miles.config.schema import ModelCfg
from miles.models import CausalLM
from miles.models.cache import SlotCache
from miles.models.context import slot_mask
from miles.models.mla import MLAttention
from miles.models.mla_decode import absorbed_attention

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
VARIANTS = {  # tiny MLA shapes: DeepSeek-V3 (YaRN, mscale^2 in the scale), GLM-4.7-Flash (v_dim != nope_dim),
    # Kimi K2 (one expert group, YaRN with beta_fast 1, more heads), V2-Lite style (no q compression)
    "deepseek_v3": ("deepseek_v3_tiny", {}),
    "glm4_7_flash": ("glm4_7_flash_tiny", {}),
    "kimi_k2": ("deepseek_v3_tiny", dict(num_heads=8, num_kv_heads=8, moe=dict(n_group=1, topk_group=1,
                                                                                routed_scaling_factor=2.827),
                                         rope_scaling=dict(beta_fast=1.0, mscale_all_dim=0.7))),
    "no_q_lora": ("deepseek_v3_tiny", dict(mla=dict(q_lora_rank=0, rope_interleave=False))),
}


def model_cfg(variant: str) -> ModelCfg:
    name, overrides = VARIANTS[variant]
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / f"{name}.yaml"),
                                               dict(vocab_size=48, **overrides)))


def random_operands(attn: MLAttention, rows: int, columns: int, dtype: torch.dtype, seed: int):
    """(q, kv, mask) of one decode step: rows at different lengths, O(1) scores (unit-scale inputs)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, attn.num_heads, 1, attn.qk_dim, generator=gen)
    kv = torch.randn(rows, columns, attn.kv_lora_rank + attn.rope_dim, generator=gen)
    lengths = torch.randint(0, columns, (rows,), generator=gen)
    lengths[0] = columns - 1  # one row sees every column
    return q.to(dtype), kv.to(dtype), slot_mask(lengths, columns)


def expanded(attn: MLAttention, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    k, v = attn.expand_kv(kv[..., :attn.kv_lora_rank], kv[..., attn.kv_lora_rank:])
    return attn.attend(q, k, v, mask)


def absorbed(attn: MLAttention, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return absorbed_attention(q, kv, mask, attn.kv_b_proj.weight, attn.nope_dim, attn.scale)


def mla_layer(variant: str, seed: int = 0) -> MLAttention:
    attn = MLAttention(CausalLM(model_cfg(variant)).config, 0)
    with torch.no_grad():  # unit-scale kv_b_proj: scores of order 1, so the softmax is not flat
        attn.kv_b_proj.weight.normal_(0.0, attn.kv_lora_rank ** -0.5, generator=torch.Generator().manual_seed(seed))
    return attn


@pytest.mark.parametrize("variant", VARIANTS)
def test_absorbed_equals_expanded_attention_in_fp32(variant):
    attn = mla_layer(variant)
    assert attn.scale != attn.qk_dim ** -0.5 or variant == "glm4_7_flash"  # YaRN's mscale^2 is in the scale
    q, kv, mask = random_operands(attn, rows=5, columns=40, dtype=torch.float32, seed=1)
    want, got = expanded(attn, q, kv, mask), absorbed(attn, q, kv, mask)
    assert got.shape == want.shape == (5, attn.num_heads, 1, attn.v_dim)
    assert (got - want).abs().max() <= 1e-5 and want.abs().max() > 0.1


def test_columns_past_a_rows_length_do_not_matter():
    attn = mla_layer("deepseek_v3")
    q, kv, mask = random_operands(attn, rows=4, columns=24, dtype=torch.float32, seed=2)
    stale = torch.where(mask[:, 0, 0, :, None], kv, torch.randn_like(kv) * 100)  # an earlier occupant's columns
    assert torch.equal(absorbed(attn, q, stale, mask), absorbed(attn, q, kv, mask))


@pytest.mark.parametrize("variant", ["deepseek_v3", "glm4_7_flash"])
def test_absorbed_bf16_is_as_close_to_fp32_as_expanded_bf16(variant):
    attn = mla_layer(variant)
    q, kv, mask = random_operands(attn, rows=6, columns=64, dtype=torch.float32, seed=3)
    reference = expanded(attn, q, kv, mask)
    low = attn.to(torch.bfloat16)
    q16, kv16 = q.bfloat16(), kv.bfloat16()
    err_absorbed = (absorbed(low, q16, kv16, mask).float() - reference).abs().max().item()
    err_expanded = (expanded(low, q16, kv16, mask).float() - reference).abs().max().item()
    scale = reference.abs().max().item()
    assert err_absorbed <= 2e-2 * scale  # bf16: 8 significant bits, sums of a few hundred terms
    assert err_absorbed <= 2 * err_expanded + 1e-3 * scale


def decode_rows(model: CausalLM, seqs: list[torch.Tensor], columns: int = 24) -> torch.Tensor:
    """Each row prefilled alone into its slot (the engine's admission), then one step for all rows
    at their own lengths: logits [rows, V] of every sequence's last token."""
    cache = SlotCache([layer.attn.new_cache(len(seqs), columns, torch.float32, "cpu") for layer in model.layers],
                      columns, len(seqs))
    for r, seq in enumerate(seqs):
        pre = model.new_cache(1, columns)
        model(seq[None, :-1], cache=pre)
        cache.load_prefill(torch.tensor([r]), pre, torch.tensor([0]), len(seq) - 1)
        cache.lengths[r] = len(seq) - 1
    return model(torch.stack([s[-1] for s in seqs])[:, None], cache=cache)[:, 0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_slot_step_of_rows_at_different_lengths_equals_the_full_forward(variant, monkeypatch):
    model = CausalLM(model_cfg(variant), seed=0).eval()
    seqs = [torch.randint(1, 48, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 11, 6, 17)]
    calls = []
    monkeypatch.setattr("miles.models.mla.absorbed_attention",
                        lambda *a, **k: calls.append(1) or absorbed_attention(*a, **k))
    with torch.no_grad():
        step = decode_rows(model, seqs)
        assert len(calls) == model.config.num_layers  # every layer took the absorbed decode
        for r, seq in enumerate(seqs):
            torch.testing.assert_close(step[r], model(seq[None])[0, -1], atol=1e-5, rtol=0)


def test_a_weight_update_reaches_the_next_absorbed_step():
    """The absorbed weights are views of kv_b_proj's live weight: nothing cached to invalidate."""
    model = CausalLM(model_cfg("deepseek_v3"), seed=0).eval()
    seqs = [torch.randint(1, 48, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    with torch.no_grad():
        before = decode_rows(model, seqs)
        state = model.state_dict()
        for name in state:
            if name.endswith("kv_b_proj.weight"):
                state[name] = state[name] + 0.05 * torch.randn_like(state[name])
        model.load_state_dict(state)
        after = decode_rows(model, seqs)
        assert (after - before).abs().max() > 1e-3
        for r, seq in enumerate(seqs):
            torch.testing.assert_close(after[r], model(seq[None])[0, -1], atol=1e-5, rtol=0)


def test_a_hooked_kv_b_proj_decodes_expanded_over_the_slot_mask(monkeypatch):
    """A kv_b_proj whose output is not its weight's product (LoRA hooks; quantized layers likewise)
    keeps the expanded form, over the slot cache's whole rows and the slot mask."""
    model = CausalLM(model_cfg("deepseek_v3"), seed=0).eval()
    for layer in model.layers:
        layer.self_attn.kv_b_proj.register_forward_hook(lambda module, args, out: out * 1.5)
    monkeypatch.setattr("miles.models.mla.absorbed_attention", lambda *a, **k: pytest.fail("absorbed a hooked layer"))
    seqs = [torch.randint(1, 48, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 13)]
    with torch.no_grad():
        step = decode_rows(model, seqs)
        for r, seq in enumerate(seqs):
            torch.testing.assert_close(step[r], model(seq[None])[0, -1], atol=1e-5, rtol=0)


def test_batch_invariant_kernels_decode_mla_slots_bit_for_bit_as_the_full_forward():
    """True on-policy's kernels keep the trainer's expanded reduction order in slots too."""
    from miles.models import invariant

    model = CausalLM(model_cfg("deepseek_v3"), seed=0).eval()
    seqs = [torch.randint(1, 48, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 11, 6)]
    with torch.no_grad(), invariant.kernels():
        step = decode_rows(model, seqs)
        for r, seq in enumerate(seqs):
            assert torch.equal(step[r], model(seq[None])[0, -1])


@pytest.mark.parametrize("name", ["deepseek_v3_2_tiny", "glm5_tiny"])
def test_dsa_slot_step_equals_the_full_forward_past_index_topk(name):
    """DSA in slots: the indexer keys live next to the latent, the top-k runs over each row's own
    columns, and attention (absorbed) over the kept ones; rows longer than index_topk (8)."""
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / f"{name}.yaml"),
                                              dict(vocab_size=48)))
    model = CausalLM(cfg, seed=0).eval()
    seqs = [torch.randint(1, 48, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 11, 17, 30)]
    with torch.no_grad():
        step = decode_rows(model, seqs, columns=40)
        for r, seq in enumerate(seqs):
            torch.testing.assert_close(step[r], model(seq[None])[0, -1], atol=1e-5, rtol=0)
