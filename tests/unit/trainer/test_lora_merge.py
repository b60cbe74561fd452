"""The native engine's merged LoRA (trainer.lora.merge_in_engine=true): each sync writes base +
alpha / rank * B @ A into the adapted weights in place, from a copy of the base taken at build.

Checked against the unmerged engine (the reference: the trainer's own forward, tested in
tests/unit/trainer/test_lora_trainer.py): the same greedy tokens and log-probs within fp32 rounding;
no drift over syncs (a later merge equals one straight from the base, bit for bit); the weights keep
their storage (views into the flat buffer, captured graphs); released weights come back right."""

import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, DType, LoRACfg, PrecisionCfg, RolloutCfg, TrainerCfg
from miles.models.lora import LoRA
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer

LORA8 = LoRACfg(rank=8, alpha=16.0)
MERGED = LoRACfg(rank=8, alpha=16.0, merge_in_engine=True)
PROMPTS, ANSWERS = ["12+30=", "7*6=", "5+5="], ["42", "42", "10"]


def _trained_adapters(ckpt, rollout_batch, steps: int = 1):
    """The adapters a torch trainer sends after `steps` RL steps (B off zero), with their checksum."""
    trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo),
                           TrainerCfg(lr=5e-2, global_batch_size=16, micro_batch_size=4, lora=LORA8),
                           PrecisionCfg(name="fp32"))
    sent = []
    for _ in range(steps):
        trainer.train_rl(rollout_batch)
        sent.append(trainer.get_weights())
    return sent


def _engine(ckpt, lora, dtype=DType.fp32):
    return NativeEngine(ckpt, RolloutCfg(max_new_tokens=6, temperature=0.0), dtype=dtype, seed=0, lora=lora)


def _greedy(engine):
    return [(s.response_ids, s.rollout_logprobs) for s in engine.generate(PROMPTS, ANSWERS, n=1)]


def test_merged_engine_samples_as_the_unmerged_one(ckpt, rollout_batch):
    (weights, digest), = _trained_adapters(ckpt, rollout_batch)
    unmerged, merged = _engine(ckpt, LORA8), _engine(ckpt, MERGED)
    ptrs = [p.data_ptr() for p in merged.model.parameters()]
    assert unmerged.update_weights(weights, digest) == digest
    assert merged.update_weights(weights, digest) == digest  # the checked sync: the adapters held
    assert [p.data_ptr() for p in merged.model.parameters()] == ptrs  # in place: flat-buffer views intact
    assert not merged.lora.enabled  # no adapter GEMMs in its forwards
    for (ids_u, lp_u), (ids_m, lp_m) in zip(_greedy(unmerged), _greedy(merged)):
        assert ids_m == ids_u
        torch.testing.assert_close(torch.tensor(lp_m), torch.tensor(lp_u), atol=2e-5, rtol=0)


def test_the_adapters_change_the_merged_engine(ckpt, rollout_batch):
    (weights, digest), = _trained_adapters(ckpt, rollout_batch)
    merged, base = _engine(ckpt, MERGED), _engine(ckpt, LoRACfg())
    before = _greedy(merged)
    assert before == _greedy(base)  # zero adapters until the first sync: the base model
    merged.update_weights(weights, digest)
    after = _greedy(merged)
    assert max(abs(a - b) for (_, la), (_, lb) in zip(after, before) for a, b in zip(la, lb)) > 1e-4


def test_merges_start_from_the_base_so_nothing_accumulates(ckpt, rollout_batch):
    """bf16 weights: merging v1 then v2 gives the bits of merging v2 alone (each merge starts from the
    base copy; subtracting v1's delta in bf16 would not)."""
    first, second = _trained_adapters(ckpt, rollout_batch, steps=2)
    twice, once = _engine(ckpt, MERGED, DType.bf16), _engine(ckpt, MERGED, DType.bf16)
    # fp32 adapters into a bf16 engine: no checksum (it hashes the bytes the engine holds).
    twice.update_weights(first[0], None)
    twice.update_weights(second[0], None)
    once.update_weights(second[0], None)
    for a, b in zip(twice.model.state_dict().values(), once.model.state_dict().values()):
        assert torch.equal(a, b)


def test_merge_is_one_rounding_of_the_fp32_sum(ckpt):
    from miles.models import from_pretrained

    model = from_pretrained(ckpt, dtype=torch.bfloat16)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = LoRA(model, rank=4, alpha=8.0, target_modules=["q_proj"], dtype=torch.bfloat16, seed=1)
    for b in lora.lora_B:
        b.data.normal_(0, 0.02)
    lora.keep_base()
    lora.merge_into_base()
    name = lora.names[0]
    expected = (base[f"{name}.weight"].float() + lora.delta(0)).to(torch.bfloat16)
    assert torch.equal(model.state_dict()[f"{name}.weight"], expected)
    untouched = [k for k in base if "q_proj" not in k]
    assert all(torch.equal(model.state_dict()[k], base[k]) for k in untouched)


@pytest.mark.parametrize("lora", [LORA8, MERGED], ids=["unmerged", "merged"])
def test_a_lora_engine_keeps_its_base_through_a_release(ckpt, rollout_batch, lora):
    """The colocated loop releases the engine's weights with keep_weights=False (a full sync refills
    them); with LoRA only the adapters travel, so the engine keeps its base (and merged weights) on
    the host instead of dropping them, and samples after resume as before."""
    (weights, digest), = _trained_adapters(ckpt, rollout_batch)
    reference, engine = _engine(ckpt, lora), _engine(ckpt, lora)
    reference.update_weights(weights, digest)
    engine.update_weights(weights, digest)
    engine.release_memory(keep_weights=False)
    engine.resume_memory()
    assert _greedy(engine) == _greedy(reference)
    engine.update_weights(weights, digest)  # the next sync merges from the base copy again
    assert _greedy(engine) == _greedy(reference)


def test_several_adapters_cannot_merge(ckpt):
    from miles.models import from_pretrained

    lora = LoRA(from_pretrained(ckpt), rank=4, alpha=8.0, adapters=["a", "b"])
    with pytest.raises(ValueError, match="cannot be merged"):
        lora.keep_base()
