"""Routing replay (R3 / R2): the trainer routes its policy forwards by the recorded experts, in padded
and packed micro-batches, and reports how often its own router agrees with the engine's."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from miles.config.schema import AlgoCfg, AlgoName, DType, FP8Scheme, ModelCfg, PrecisionCfg, RolloutCfg, TrainerCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.trainer import torch_trainer
from miles.trainer.packing import packed_micro_batches, padded_micro_batches, shared_prompt_micro_batches
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import build_train_batch, index_layers, keys_replay, moe_layers, routing_replay, stack_keys, stack_routing

CONF = Path(__file__).resolve().parents[3] / "conf"
PROMPTS = ["1+2=", "35+47=", "9*9=", "(12-3)*4="]
FP32 = PrecisionCfg(name="fp32")
# deepseek_v3_tiny: a dense first layer (MoE layers 1, 2), group-limited routing, MLA; qwen3_moe_tiny: GQA.
FAMILIES = ["qwen3_moe_tiny", "deepseek_v3_tiny"]


def load(group: str, name: str, schema):
    yaml = OmegaConf.load(CONF / group / f"{name}.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), yaml))


# w8a8: its 1x128 activation rounding is what flips the two sides' routers (w8a16, fp8's default, flipped
# none on qwen3_moe_tiny).
# The fp32 residual stream (precision.fp32_residual=true) makes the trainer round otherwise than the
# engine: its routers and indexers then disagree with the engine's on some tokens, what replay is for.
# With the default bf16 stream they agreed on every token of these batches.
FP8 = replace(load("precision", "fp8", PrecisionCfg), fp8_scheme=FP8Scheme.w8a8, fp32_residual=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = str(random_checkpoint(load("model", name, ModelCfg), DEFAULT_ALPHABET, 0,
                                               tmp_path_factory.mktemp(name)))
        return made[name]

    return get


_ROLLOUTS: dict = {}


def rollout(ckpt: str, precision: PrecisionCfg, dtype: DType):
    """8 samples of a recording engine (cached per checkpoint and precision), GRPO-like advantages."""
    key = (ckpt, precision.name)
    if key not in _ROLLOUTS:
        engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=8), dtype, precision=precision, record_routing=True)
        samples = engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=2)
        _ROLLOUTS[key] = build_train_batch(samples, torch.linspace(-1, 1, len(samples)), engine.pad_id)
    return _ROLLOUTS[key]


def trainer(ckpt: str, mode: str, precision: PrecisionCfg, pack: bool = True, recompute: bool = False,
            **algo) -> TorchTrainer:
    cfg = TrainerCfg(global_batch_size=8, micro_batch_size=4, pack_sequences=pack, max_tokens_per_micro_batch=64,
                     recompute=recompute)
    return TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo, routing_replay=mode, **algo), cfg, precision,
                        reuse_forward_for_old=False)


@pytest.mark.parametrize("name", FAMILIES)
def test_micro_batch_layouts_carry_the_engine_routing(checkpoints, name):
    """fp32, where the trainer's router chooses as the engine did: in every layout, the replay tensor
    equals the trainer's own routing at every loss position, and replaying it changes nothing."""
    ckpt = checkpoints(name)
    batch = rollout(ckpt, FP32, DType.fp32)
    model = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(), FP32).model.eval()
    layers = moe_layers(model.config)
    layouts = {"padded": padded_micro_batches(batch, 3), "packed": packed_micro_batches(batch, 64),
               "shared": shared_prompt_micro_batches(batch, 64)}
    for layout, plan in layouts.items():
        for mb in plan:
            kwargs = {} if mb.segment_ids is None else dict(position_ids=mb.position_ids, segment_ids=mb.segment_ids,
                                                           branch_ids=mb.branch_ids)
            record: dict = {}
            logits = model(mb.input_ids, routing_record=record, **kwargs)
            own = stack_routing(record, layers).flatten(0, 1)[mb.src]
            assert torch.equal(own, mb.routing.flatten(0, 1)[mb.src].long()), layout
            replayed = model(mb.input_ids, routing_replay=routing_replay(mb.routing, layers), **kwargs)
            torch.testing.assert_close(replayed.flatten(0, 1)[mb.src], logits.flatten(0, 1)[mb.src])
            # A different routing is honoured by every MoE layer (keys are layer indices).
            forced = (mb.routing.long() + 1) % model.config.moe.num_experts
            record = {}
            model(mb.input_ids, routing_replay=routing_replay(forced, layers), routing_record=record, **kwargs)
            assert torch.equal(stack_routing(record, layers), forced)


@pytest.mark.parametrize("name, pack", [("qwen3_moe_tiny", True), ("deepseek_v3_tiny", False)])
def test_fp8_routing_flips_and_r3_replays_the_engine(checkpoints, name, pack, monkeypatch):
    """Under fp8 (fake-quantized training forward vs the engine's FP8 weights) the routers disagree on
    some tokens; with r3 every policy forward routes by the engine's experts, and ppo_kl == 0."""
    ckpt = checkpoints(name)
    batch = rollout(ckpt, FP8, DType.bf16)
    width = batch.loss_mask.shape[1]
    calls = []
    original = torch_trainer.token_logprobs_of

    def spy(model, recipe, mb, *args, routing_replay=None, routing_record=None, **kw):
        if routing_replay is not None:
            # What it replays at the loss positions is the engine's record of those tokens...
            rank, pos = mb.dst // width, mb.dst % width
            layers = sorted(routing_replay)
            replay = torch.stack([routing_replay[layer] for layer in layers], -2).flatten(0, 1)[mb.src]
            assert torch.equal(replay, batch.routed_experts[mb.index[rank], pos])
            routing_record = {}  # ...and every MoE layer routes by it
            out = original(model, recipe, mb, *args, routing_replay=routing_replay, routing_record=routing_record, **kw)
            assert all(torch.equal(routing_record[layer], routing_replay[layer].long()) for layer in layers)
            calls.append("replay")
            return out
        calls.append("own")
        return original(model, recipe, mb, *args, routing_replay=routing_replay, routing_record=routing_record, **kw)

    monkeypatch.setattr(torch_trainer, "token_logprobs_of", spy)
    plain = trainer(ckpt, "none", FP8, pack).train_rl(batch)
    assert set(calls) == {"own"}
    calls.clear()
    r3 = trainer(ckpt, "r3", FP8, pack).train_rl(batch)
    assert calls.count("own") == len(calls) // 3  # the agreement pass; old-log-prob and update replay
    assert plain["mismatch/routing_agreement"] < 1  # the trainer's own router flips some choices
    assert r3["mismatch/routing_agreement"] == plain["mismatch/routing_agreement"]
    assert r3["mismatch/logprob_abs_diff_no_replay"] == plain["mismatch/logprob_abs_diff"]
    assert r3["train/ppo_kl"] == 0.0


@pytest.mark.parametrize("name, pack", [("qwen3_moe_tiny", True), ("deepseek_v3_tiny", False),
                                       ("deepseek_v3_2_tiny", False)])
def test_r3_under_fp8_with_recompute_is_the_stored_activation_step(checkpoints, name, pack):
    """trainer.recompute: each layer's recomputation routes by the replayed experts (DSA: and keys; they
    travel in the layer's context) on the forward's FP8 weights: the step's metrics and weights are
    exactly those of the run that stores its activations."""
    ckpt = checkpoints(name)
    batch = rollout(ckpt, FP8, DType.bf16)
    stored, recomputed = trainer(ckpt, "r3", FP8, pack), trainer(ckpt, "r3", FP8, pack, recompute=True)
    assert stored.train_rl(batch) == recomputed.train_rl(batch)
    ours, theirs = stored.model.state_dict(), recomputed.model.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_r2_replays_the_old_logprob_pass_routing(checkpoints, monkeypatch):
    ckpt = checkpoints("qwen3_moe_tiny")
    batch = replace(rollout(ckpt, FP8, DType.bf16), routed_experts=torch.zeros(0))  # r2 needs no engine record
    recorded, replayed = [], []
    original = torch_trainer.token_logprobs_of

    def spy(*args, routing_replay=None, routing_record=None, **kw):
        out = original(*args, routing_replay=routing_replay, routing_record=routing_record, **kw)
        if routing_record is not None:
            recorded.append(routing_record)
        if routing_replay is not None:
            replayed.append(routing_replay)
        return out

    monkeypatch.setattr(torch_trainer, "token_logprobs_of", spy)
    metrics = trainer(ckpt, "r2", FP8).train_rl(batch)  # a separate old-log-prob pass records
    assert recorded and len(replayed) == len(recorded)
    assert all(a is b for a, b in zip(replayed, recorded))  # each update forward replays its micro-batch's record
    assert "mismatch/routing_agreement" not in metrics  # no engine record: no agreement
    assert metrics["train/ppo_kl"] == 0.0


def test_replay_modes_need_moe_and_r3_needs_the_record(checkpoints, tmp_path, compose):
    ckpt = checkpoints("qwen3_moe_tiny")
    batch = replace(rollout(ckpt, FP32, DType.fp32), routed_experts=torch.zeros(0))
    with pytest.raises(ValueError, match="record_routing"):
        trainer(ckpt, "r3", FP32).train_rl(batch)
    dense = ModelCfg(name="d", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, max_position_embeddings=64)
    with pytest.raises(ValueError, match="needs an MoE model"):
        trainer(str(random_checkpoint(dense, DEFAULT_ALPHABET, 0, tmp_path)), "r2", FP32)
    from miles.validate import validate

    assert not [p for p in validate(compose(["model=qwen3_moe_tiny", "algo.routing_replay=r3"])) if "routing" in p]
    assert any("no MoE layer" in p for p in validate(compose(["algo.routing_replay=r2"])))
    assert any("unknown" in p and "routing_replay" in p for p in validate(compose(["algo.routing_replay=r4"])))


@pytest.mark.parametrize("name", ["deepseek_v3_2_tiny", "glm5_tiny"])
def test_dsa_indexer_selection_is_recorded_and_replayed(checkpoints, name):
    """DSA models (index_topk 8, so prompts + responses run past it): the engine records the keys each
    indexer kept; in fp32 the trainer's own indexers keep the same keys at every loss position, replaying
    the record changes nothing, and a different selection is honoured by every indexer layer."""
    ckpt = checkpoints(name)
    batch = rollout(ckpt, FP32, DType.fp32)
    model = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(), FP32).model.eval()
    layers = index_layers(model.config)
    assert batch.selected_keys.shape[2:] == (len(layers), model.config.dsa.index_topk)
    for mb in padded_micro_batches(batch, 3):
        record: dict = {}
        logits = model(mb.input_ids, routing_record=record)
        own = stack_keys(record, layers).flatten(0, 1)[mb.src]
        engine = mb.selected_keys.flatten(0, 1)[mb.src].to(own.dtype)
        assert torch.equal(own, engine)
        assert (engine[..., -1] >= 0).any()  # some queries see more keys than index_topk: sparse regime
        replayed = model(mb.input_ids, routing_replay=keys_replay(mb.selected_keys, layers))
        torch.testing.assert_close(replayed.flatten(0, 1)[mb.src], logits.flatten(0, 1)[mb.src])
        forced = mb.selected_keys.clone()
        forced[..., 1:] = -1  # only the earliest kept key
        record = {}
        model(mb.input_ids, routing_replay=keys_replay(forced, layers), routing_record=record)
        assert torch.equal(stack_keys(record, layers).flatten(0, 1)[mb.src], forced.flatten(0, 1)[mb.src].long())


def test_fp8_flips_dsa_selections_and_r3_replays_them(checkpoints):
    ckpt = checkpoints("deepseek_v3_2_tiny")
    batch = rollout(ckpt, FP8, DType.bf16)
    plain = trainer(ckpt, "none", FP8, pack=False).train_rl(batch)
    r3 = trainer(ckpt, "r3", FP8, pack=False).train_rl(batch)
    assert plain["mismatch/index_agreement"] < 1  # the trainer's own indexers keep other keys at times
    assert r3["train/ppo_kl"] == 0.0
    assert r3["mismatch/logprob_abs_diff"] < plain["mismatch/logprob_abs_diff"]
