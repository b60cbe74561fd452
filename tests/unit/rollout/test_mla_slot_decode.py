"""MLA families (DeepSeek-V3, Kimi K2, GLM-4.7-Flash) and DSA (DeepSeek-V3.2, GLM-5) in the slot decoder
on the CPU, fp32: the same
samples as the padded engine, log-probs of the full forward, MoE routing records, weight updates,
quantized rollouts, colocation's release / resume, and speculative verify steps in slots.

The slot cache holds the latent + rope key per column and the one-token steps take the absorbed
decode (miles/models/mla_decode.py; tests/unit/models/test_mla_absorbed.py checks it against the
expanded attention). CUDA graphs: tests/gpu/test_mla_slot_decode_cuda.py.
"""

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from miles.config.schema import DType, ModelCfg, PrecisionCfg, Quant, RolloutCfg, SpeculativeCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import from_pretrained
from miles.models.mla_decode import absorbed_attention
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.types import moe_layers, stack_routing

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
FAMILIES = {  # variant -> (conf/model file, overrides): Kimi K2 is DeepSeek-V3's architecture, one expert group
    "deepseek_v3": ("deepseek_v3_tiny", {}),
    "glm4_7_flash": ("glm4_7_flash_tiny", {}),
    "kimi_k2": ("deepseek_v3_tiny", dict(num_heads=8, num_kv_heads=8, moe=dict(n_group=1, topk_group=1,
                                                                                routed_scaling_factor=2.827),
                                         rope_scaling=dict(beta_fast=1.0))),
    # DSA: MLA over the keys the indexer keeps (index_topk 8, below the rows' lengths); GLM-5 shares
    # one layer's selection with the next
    "deepseek_v3_2": ("deepseek_v3_2_tiny", {}),
    "glm5": ("glm5_tiny", {}),
}
PROMPTS = [f"{a}+{b}=" for a, b in zip(range(10, 99, 7), range(99, 9, -7))][:10]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(variant: str, seed: int = 0) -> str:
        if (variant, seed) not in made:
            name, overrides = FAMILIES.get(variant, (variant, {}))
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg),
                                                      OmegaConf.load(CONF / f"{name}.yaml"), overrides))
            made[variant, seed] = str(random_checkpoint(cfg, DEFAULT_ALPHABET, seed, tmp_path_factory.mktemp(variant)))
        return made[variant, seed]

    return get


def engine(ckpt: str, slots: bool, record_routing: bool = False, precision: PrecisionCfg | None = None,
           **kw) -> NativeEngine:
    cfg = replace(RolloutCfg(max_new_tokens=10, max_prompt_len=16, max_running=6, sync_every=3, n_samples_per_prompt=2,
                             slot_decode=slots), **kw)
    return NativeEngine(ckpt, cfg, DType.fp32, seed=0, record_routing=record_routing, precision=precision)


def max_logprob_diff(a, b) -> float:
    return max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.rollout_logprobs, t.rollout_logprobs))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_slot_decode_equals_the_padded_engine_with_refills_and_stops(checkpoint, family, monkeypatch):
    slots, padded = engine(checkpoint(family), True), engine(checkpoint(family), False)
    assert slots.slots is not None and padded.slots is None and slots.slots.slots == 6
    absorbed = []
    monkeypatch.setattr("miles.models.mla.absorbed_attention",
                        lambda *a, **k: absorbed.append(1) or absorbed_attention(*a, **k))
    cfg = slots.model.config
    # Per token and layer the latent + rope key, not per-head K / V (+ the indexer key, on DSA layers
    # with an indexer of their own).
    widths = cfg.num_layers * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    if cfg.dsa is not None:
        widths += (cfg.num_layers - len(cfg.dsa.shared_layers)) * cfg.dsa.index_head_dim
    assert slots.slots.nbytes() == widths * slots.slots.slots * slots.slots.max_len * 4
    # Also stop at a token the random model emits in some responses, so rows finish at different steps.
    greedy = padded.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)
    frequent = Counter(t for s in greedy for t in s.response_ids[1:]).most_common(1)[0][0]
    stop = torch.tensor([frequent, slots.tok.eos_id])
    slots.stop_ids, padded.stop_ids = stop, stop
    a = slots.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=0.0)  # 20 samples through 6 slots
    b = padded.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=0.0)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    assert {s.finish_reason.value for s in a} == {"stop", "length"}  # rows finish at different steps
    assert max_logprob_diff(a, b) < 1e-5
    assert absorbed  # the decode steps took the absorbed form


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_7_flash", "glm5"])
def test_sampled_slot_responses_have_the_full_forward_logprobs(checkpoint, family):
    slots = engine(checkpoint(family), True)
    model = from_pretrained(checkpoint(family), dtype=torch.float32).eval()
    samples = slots.generate(PROMPTS, ["?"] * len(PROMPTS), n=3)
    assert len({len(s.prompt_ids) + len(s.response_ids) for s in samples}) > 1  # rows of different lengths
    with torch.no_grad():
        for s in samples[::4]:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp = torch.log_softmax(model(ids)[0, :-1], -1)
            start = len(s.prompt_ids) - 1
            full = logp[start:].gather(1, ids[0, start + 1:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(s.rollout_logprobs), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_7_flash"])
def test_slot_engine_records_the_full_forward_moe_routing(checkpoint, family):
    slots = engine(checkpoint(family), True, record_routing=True, max_running=4, sync_every=2, stop_tokens=list("0123"))
    layers = moe_layers(slots.model.config)
    samples = slots.generate(PROMPTS[:4], ["?"] * 4, n=2, temperature=1.0)  # 8 samples in 4 slots
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])[:, :-1]
        record: dict = {}
        slots.model(ids, routing_record=record)
        assert torch.equal(s.routed_experts, stack_routing(record, layers, s.routed_experts.dtype)[0])


def test_a_weight_update_changes_the_slot_decode_as_the_padded_one(checkpoint):
    slots, padded = engine(checkpoint("deepseek_v3"), True), engine(checkpoint("deepseek_v3"), False)
    before = slots.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)
    new = from_pretrained(checkpoint("deepseek_v3", seed=1), dtype=torch.float32).state_dict()
    slots.update_weights(new)
    padded.update_weights(new)
    a = slots.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)
    b = padded.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)
    assert [s.response_ids for s in a] != [s.response_ids for s in before]
    assert [s.response_ids for s in a] == [s.response_ids for s in b] and max_logprob_diff(a, b) < 1e-5


@pytest.mark.parametrize("quant", [Quant.fp8, Quant.int4])
def test_a_quantized_kv_b_proj_decodes_in_slots_as_on_the_padded_path(checkpoint, quant, monkeypatch):
    """Weight-only quantized rollouts: kv_b_proj is a QuantLinear, whose weight is not the math, so the
    slot steps keep the expanded form (over the slot mask) and equal the padded engine."""
    precision = PrecisionCfg(name=quant.value, train_dtype=DType.fp32, rollout_dtype=DType.fp32, train_quant=quant,
                             rollout_quant=quant)
    slots = engine(checkpoint("deepseek_v3"), True, precision=precision)
    padded = engine(checkpoint("deepseek_v3"), False, precision=precision)
    assert type(slots.model.layers[0].self_attn.kv_b_proj).__name__ == "QuantLinear"
    monkeypatch.setattr("miles.models.mla.absorbed_attention", lambda *a, **k: pytest.fail("absorbed a QuantLinear"))
    a = slots.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=0.0)
    b = padded.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=0.0)
    assert [s.response_ids for s in a] == [s.response_ids for s in b] and max_logprob_diff(a, b) < 1e-5


def test_release_and_resume_keep_the_slot_decode(checkpoint):
    slots = engine(checkpoint("glm4_7_flash"), True)
    want = slots.generate(PROMPTS[:4], ["?"] * 4, n=2, temperature=0.0)
    held = slots.held_bytes()["kv_cache"]
    slots.release_memory()
    assert slots.held_bytes()["kv_cache"] == 0
    slots.resume_memory()
    assert slots.held_bytes()["kv_cache"] == held
    got = slots.generate(PROMPTS[:4], ["?"] * 4, n=2, temperature=0.0)
    assert [s.response_ids for s in got] == [s.response_ids for s in want]


def test_dsa_routing_records_stay_on_the_padded_path(checkpoint):
    """The slot decoder records MoE experts only; a DSA model's record also holds the kept keys."""
    with pytest.raises(ValueError, match="kept keys"):
        engine(checkpoint("deepseek_v3_2"), True, record_routing=True)
    assert engine(checkpoint("deepseek_v3_2"), True).slots is not None


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_2"])
def test_speculative_verify_steps_run_in_mla_slots(checkpoint, family):
    """A GQA draft proposes, the MLA / DSA target verifies several tokens per row in its slot cache."""
    cfg = RolloutCfg(max_new_tokens=12, max_prompt_len=16, max_running=6)
    plain = NativeEngine(checkpoint(family), replace(cfg, slot_decode=False))
    spec = NativeEngine(checkpoint(family), replace(cfg, slot_decode=True, speculative=SpeculativeCfg(
        kind="draft_model", num_tokens=3)), draft_dir=checkpoint("qwen3_tiny"))
    assert spec.spec is not None and type(spec.spec).__name__ == "SlotSpeculativeDecoder"
    a = plain.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=0.0)
    b = spec.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=0.0)
    assert [s.response_ids for s in a] == [s.response_ids for s in b] and max_logprob_diff(a, b) < 2e-5
