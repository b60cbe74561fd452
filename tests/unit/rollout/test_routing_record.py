"""Routing record (R3): the experts the engine reports per sample are those a full forward of the
sample's tokens chooses, for every MoE family of the zoo, on the padded and the slot path."""

import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from miles.config.schema import ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.types import (build_train_batch, index_layers, moe_layers, tensor_from_json, tensor_to_json, stack_keys,
                         stack_routing)

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
# Every tiny config with MoE layers (DSA families too: their MoE routing is recorded alike).
MOE_TINY = sorted(p.stem for p in CONF.glob("*_tiny.yaml") if "\nmoe:" in p.read_text())
PROMPTS = ["1+2=", "35+47=", "9*9=", "(12-3)*4="]


def model_cfg(name: str) -> ModelCfg:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / f"{name}.yaml")))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = str(random_checkpoint(model_cfg(name), DEFAULT_ALPHABET, 0, tmp_path_factory.mktemp(name)))
        return made[name]

    return get


def full_forward_routing(engine: NativeEngine, sample) -> torch.Tensor:
    """The experts a plain forward of the sample's input tokens (all but the last) chooses."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])[:, :-1]
    record: dict = {}
    engine.model(ids, routing_record=record)
    return stack_routing(record, moe_layers(engine.model.config), torch.uint8)[0]


def check_samples(engine: NativeEngine, samples) -> None:
    cfg = engine.model.config
    for s in samples:
        experts = s.routed_experts
        assert experts.dtype == torch.uint8 and experts.is_contiguous()
        assert experts.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, len(moe_layers(cfg)),
                                 cfg.moe.num_experts_per_tok)
        assert torch.equal(experts, full_forward_routing(engine, s))


def test_every_moe_family_is_covered():
    assert {"qwen3_moe_tiny", "deepseek_v3_tiny", "glm4_moe_tiny", "minimax_m2_tiny", "llama4_tiny"} <= set(MOE_TINY)


@pytest.mark.parametrize("name", MOE_TINY)
def test_padded_engine_records_the_full_forward_routing(checkpoints, name):
    # Frequent stop tokens: rows finish at different steps, and compacting at every finish moves rows.
    cfg = RolloutCfg(max_new_tokens=6, stop_tokens=list("0123"), slot_decode=False)
    engine = NativeEngine(checkpoints(name), cfg, seed=1, record_routing=True)
    engine.compact_at = 0.01
    samples = engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=1.0)
    assert len({len(s.response_ids) for s in samples}) > 1  # ragged lengths
    check_samples(engine, samples)


def test_slot_engine_records_the_full_forward_routing(checkpoints):
    # 8 samples in 4 slots: refills, finished rows riding along, tail compaction.
    cfg = RolloutCfg(max_new_tokens=6, max_prompt_len=16, max_running=4, sync_every=2, stop_tokens=list("0123"),
                     slot_decode=True)
    engine = NativeEngine(checkpoints("qwen3_moe_tiny"), cfg, seed=1, record_routing=True)
    assert engine.slots is not None
    samples = engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=1.0)
    check_samples(engine, samples)
    # A shorter second call: slots left from the first one must not leak into its records.
    check_samples(engine, engine.generate(PROMPTS[:3], ["?"] * 3, n=1, temperature=1.0, max_new_tokens=2))


def test_without_recording_nothing_changes(checkpoints):
    ckpt = checkpoints("qwen3_moe_tiny")
    plain = NativeEngine(ckpt, RolloutCfg(max_new_tokens=6), seed=2).generate(PROMPTS, ["?"] * 4, n=2)
    recording = NativeEngine(ckpt, RolloutCfg(max_new_tokens=6), seed=2, record_routing=True).generate(
        PROMPTS, ["?"] * 4, n=2)
    assert all(s.routed_experts is None for s in plain)
    assert [s.response_ids for s in plain] == [s.response_ids for s in recording]
    assert [s.rollout_logprobs for s in plain] == [s.rollout_logprobs for s in recording]


def test_recording_needs_an_moe_model(tmp_path):
    dense = ModelCfg(name="d", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, max_position_embeddings=64)
    with pytest.raises(ValueError, match="needs an MoE model"):
        NativeEngine(str(random_checkpoint(dense, DEFAULT_ALPHABET, 0, tmp_path)), RolloutCfg(), record_routing=True)


def test_samples_carry_routing_through_pickle_json_and_the_train_batch(checkpoints):
    engine = NativeEngine(checkpoints("llama4_tiny"), RolloutCfg(max_new_tokens=5), seed=3, record_routing=True)
    samples = engine.generate(PROMPTS, ["?"] * 4, n=2)
    for s in samples:
        assert torch.equal(pickle.loads(pickle.dumps(s)).routed_experts, s.routed_experts)  # Ray pickles Samples
        assert torch.equal(tensor_from_json(tensor_to_json(s.routed_experts)), s.routed_experts)
    batch = build_train_batch(samples, torch.zeros(len(samples)), engine.pad_id)
    assert batch.routed_experts.shape == (*batch.tokens.shape, 2, 1)  # llama4_tiny: 2 MoE layers, top-1
    for i, s in enumerate(samples):
        covered = len(s.prompt_ids) + len(s.response_ids) - 1
        assert torch.equal(batch.routed_experts[i, :covered], s.routed_experts)
        assert not batch.routed_experts[i, covered:].any()  # last token and padding: expert 0
    assert torch.equal(batch.slice(2, 5).routed_experts, batch.routed_experts[2:5])
    with pytest.raises(ValueError, match="mixes"):
        build_train_batch([samples[0], replace(samples[1], routed_experts=None)], torch.zeros(2), engine.pad_id)


@pytest.mark.parametrize("name", ["deepseek_v3_2_tiny", "glm5_tiny"])
def test_dsa_engines_record_the_keys_a_full_forward_selects(checkpoints, name):
    """Left-padded prefill + decode record, per input position and indexer layer, the positions of the
    keys the indexer kept: those of a plain forward of the sample's tokens, through pickle and JSON too."""
    engine = NativeEngine(checkpoints(name), RolloutCfg(max_new_tokens=8), seed=1, record_routing=True)
    layers, topk = index_layers(engine.model.config), engine.model.config.dsa.index_topk
    samples = engine.generate(PROMPTS, ["?"] * 4, n=2)
    for s in samples:
        keys = s.selected_keys
        assert keys.dtype == torch.int16 and keys.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, len(layers), topk)
        ids = torch.tensor([s.prompt_ids + s.response_ids])[:, :-1]
        record: dict = {}
        engine.model(ids, routing_record=record)
        assert torch.equal(keys, stack_keys(record, layers, torch.int16)[0])
        assert torch.equal(pickle.loads(pickle.dumps(s)).selected_keys, keys)
        assert torch.equal(tensor_from_json(tensor_to_json(keys)), keys)
    assert any((s.selected_keys[-1] >= 0).all() for s in samples)  # past index_topk keys: every slot used
    batch = build_train_batch(samples, torch.zeros(len(samples)), engine.pad_id)
    assert batch.selected_keys.shape == (*batch.tokens.shape, len(layers), topk)
    covered = len(samples[0].prompt_ids) + len(samples[0].response_ids) - 1
    assert (batch.selected_keys[0, covered:] == -1).all()  # last token and padding: no record
