"""Several LoRA adapters over one frozen base (trainer.lora.adapters) on the torch trainer and the
native engine, in-process, against references computed without them:

- a step on a batch mixing two adapters moves each adapter as a single-adapter trainer moves it on
  that adapter's samples alone (the same optimizer, SGD: an update linear in the gradient, so any
  other normalizer or a clip shared between the adapters would show; fp32 tolerance), and an adapter
  with no sample in a step gets no gradient and is not stepped (its AdamW moments notwithstanding);
- the engine decodes a batch mixing the adapters as single-adapter engines decode each group
  alone (greedy: the same tokens), on the padded path and in slots;
- the sync carries every adapter (bytes x N) and the checked sync covers them; resume is exact;
  the export is the base with each adapter in PEFT's format beside it.
"""

from dataclasses import replace

import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, LoRACfg, PrecisionCfg, RolloutCfg, TrainerCfg
from miles.models import from_pretrained
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer
from miles.transport.checksum import WeightSyncError

FP32 = PrecisionCfg(name="fp32")
ONE = LoRACfg(rank=8, alpha=16.0)
TWO = replace(ONE, adapters=["add", "mul"], adapter_key="adapter")
# Small micro-batches (several per step) and a clip below the gradients' norms: both in the update.
CFG = TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=4, grad_clip=0.05)


# The micro-batch layouts (miles/trainer/packing.py): the route per row, or per token of packed rows;
# and a backward that recomputes each layer (trainer.recompute), after the forward set the route.
LAYOUTS = {"shared_prompts": {}, "packed": {"share_prompts": False}, "padded": {"pack_sequences": False},
           "recompute": {"recompute": True}}


def _trainer(ckpt, lora, optimizer="adamw", **cfg):
    return TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), replace(CFG, lora=lora, **cfg), FP32, optimizer=optimizer)


@pytest.fixture
def mixed(rollout_batch):
    """The fixture's 16 samples, prompts 0 and 2 routed to "add", 1 and 3 to "mul" (interleaved groups)."""
    groups = torch.arange(16) // 4
    return replace(rollout_batch, adapter_ids=(groups % 2).long())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_adapter_steps_as_if_it_were_alone(ckpt, mixed, layout):
    two = _trainer(ckpt, TWO, "sgd", **LAYOUTS[layout])
    start = {k: v.detach().clone() for k, v in two.lora.tensors().items()}
    m = two.train_rl(mixed)
    for k, name in enumerate(TWO.adapters):
        rows = (mixed.adapter_ids == k).nonzero().squeeze(1)
        alone = _trainer(ckpt, ONE, "sgd")
        alone.lora.load({key.partition("/")[2]: v for key, v in start.items() if key.startswith(f"{name}/")})
        part = replace(mixed, adapter_ids=torch.zeros(0, dtype=torch.long))
        ref = alone.train_rl(_rows(part, rows))
        got = {key: v.detach() for key, v in two.lora.tensors(k).items()}
        assert any(not torch.equal(got[key], start[f"{name}/{key}"]) for key in got)
        assert max(float((got[key] - v.detach()).abs().max()) for key, v in alone.lora.tensors().items()) <= 1e-7
        assert abs(m[f"train/grad_norm/{name}"] - ref["train/grad_norm"]) <= 1e-5 * ref["train/grad_norm"]
        assert ref["train/grad_norm"] > CFG.grad_clip  # the clip took part, adapter by adapter
        assert abs(m[f"train/pg_loss/{name}"] - ref["train/pg_loss"]) <= 1e-6
    norms = torch.tensor([m["train/grad_norm/add"], m["train/grad_norm/mul"]])
    assert abs(m["train/grad_norm"] - float(norms.norm())) <= 1e-6


def test_an_adapter_without_samples_is_left_as_it_is(ckpt, mixed):
    two = _trainer(ckpt, TWO)
    two.train_rl(mixed)  # both adapters stepped: AdamW moments for both
    before = {k: v.detach().clone() for k, v in two.lora.tensors().items()}
    only_add = replace(mixed, adapter_ids=torch.zeros(16, dtype=torch.long))
    # The loss of "add"'s rows gives "mul" an exactly zero gradient (its rows route through it alone).
    two.optimizer.zero_grad()
    plan = two.plan(only_add, two.model)
    sum(two.forward(two.model, mb)[0].sum() for mb in plan).backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in two.lora.adapter_parameters(0))
    assert all(p.grad is None or not p.grad.any() for p in two.lora.adapter_parameters(1))
    m = two.train_rl(only_add)
    after = two.lora.tensors()
    assert all(torch.equal(after[k], v) for k, v in before.items() if k.startswith("mul/"))
    assert any(not torch.equal(after[k], v) for k, v in before.items() if k.startswith("add/"))
    assert "train/grad_norm/add" in m and "train/pg_loss/mul" not in m


def test_a_batch_without_adapter_ids_is_refused(ckpt, rollout_batch):
    with pytest.raises(ValueError, match="does not name each sample's adapter"):
        _trainer(ckpt, TWO).train_rl(rollout_batch)


@pytest.mark.parametrize("slots", [False, True], ids=["padded", "slots"])
def test_engine_serves_mixed_adapters_as_each_alone(ckpt, mixed, slots):
    two = _trainer(ckpt, TWO)
    two.train_rl(mixed)
    weights, digest = two.get_weights()
    one_bytes = sum(t.numel() * t.element_size() for t in _trainer(ckpt, ONE).get_weights()[0].values())
    assert sum(t.numel() * t.element_size() for t in weights.values()) == 2 * one_bytes
    cfg = RolloutCfg(max_new_tokens=6, temperature=0.0, slot_decode=slots)
    engine = NativeEngine(ckpt, cfg, seed=0, lora=TWO)
    assert engine.update_weights(weights, digest) == digest  # the checked sync covers both adapters
    with pytest.raises(WeightSyncError):
        engine.update_weights(weights, "0" * 64)
    prompts, labels, routes = ["1+2=", "33+4=", "50+50=", "7+8="], ["3", "37", "100", "15"], [0, 1, 1, 0]
    mixed_samples = engine.generate(prompts, labels, n=2, adapters=routes)
    assert [s.adapter for s in mixed_samples] == [a for a in routes for _ in range(2)]
    for k, name in enumerate(TWO.adapters):
        alone = NativeEngine(ckpt, cfg, seed=0, lora=ONE)
        alone.update_weights({key.partition("/")[2]: v for key, v in weights.items() if key.startswith(f"{name}/")})
        mine = [i for i, a in enumerate(routes) if a == k]
        ref = alone.generate([prompts[i] for i in mine], [labels[i] for i in mine], n=2)
        got = [s for s in mixed_samples if s.adapter == k]
        assert [s.response_ids for s in got] == [s.response_ids for s in ref]
        for s, r in zip(got, ref):
            torch.testing.assert_close(torch.tensor(s.rollout_logprobs), torch.tensor(r.rollout_logprobs),
                                       atol=1e-5, rtol=0)
    # The adapters matter: the same prompts under the other adapter decode otherwise.
    swapped = engine.generate(prompts, labels, n=2, adapters=[1 - a for a in routes])
    assert [s.rollout_logprobs for s in swapped] != [s.rollout_logprobs for s in mixed_samples]
    with pytest.raises(ValueError, match="one LoRA adapter id per prompt"):
        engine.generate(prompts, labels, n=2)


def test_resume_is_exact_and_the_export_holds_each_adapter(ckpt, mixed, tmp_path):
    a = _trainer(ckpt, TWO)
    a.train_rl(mixed)
    a.save_state(str(tmp_path / "state"))
    assert all((tmp_path / f"state/adapter/{name}/adapter_model.safetensors").is_file() for name in TWO.adapters)
    b = _trainer(ckpt, TWO)
    b.load_state(str(tmp_path / "state"))
    assert a.train_rl(mixed) == b.train_rl(mixed)
    assert all(torch.equal(b.lora.tensors()[k], v) for k, v in a.lora.tensors().items())
    a.save(str(tmp_path / "final"))
    base = from_pretrained(ckpt).state_dict()  # several adapters: the export's model is the frozen base
    assert all(torch.equal(base[k], v) for k, v in from_pretrained(tmp_path / "final").state_dict().items())
    again = _trainer(ckpt, TWO)
    from miles.trainer.lora import load_adapter

    load_adapter(again.lora, again.model, tmp_path / "final")
    assert all(torch.equal(again.lora.tensors()[k], v) for k, v in a.lora.tensors().items())


def _rows(batch, rows):
    """The samples `rows` of a TrainBatch, every per-sample field."""
    from miles.trainer.packing import select

    return select(batch, rows)


def test_every_layout_routes_each_token_by_its_sample(rollout_batch):
    """One prompt's samples under two adapters: the packed layouts give each laid-out token its
    sample's adapter, and a prompt is shared only within an adapter."""
    from miles.trainer.packing import padded_micro_batches, packed_micro_batches, shared_prompt_micro_batches

    batch = rollout_batch.slice(0, 4)  # the 4 samples of one prompt
    twice = replace(_cat(batch, batch), adapter_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    for mb in packed_micro_batches(twice, 4096) + shared_prompt_micro_batches(twice, 4096):
        flat, sample, _ = mb.layout
        assert torch.equal(mb.adapter_ids.reshape(-1)[flat], twice.adapter_ids[sample])
    shared = shared_prompt_micro_batches(twice, 4096)
    groups = sum(len({(r, int(g)) for r, row in enumerate(mb.segment_ids) for g in row if g > 0}) for mb in shared)
    assert groups == 2  # the prompt laid out once per adapter, not once for all 8 samples
    for mb in padded_micro_batches(twice, 3):
        assert torch.equal(mb.adapter_ids[:, 0], twice.adapter_ids[mb.index])


def _cat(a, b):
    from dataclasses import fields

    return replace(a, **{f.name: torch.cat([getattr(a, f.name), getattr(b, f.name)]) for f in fields(a)
                         if isinstance(getattr(a, f.name), torch.Tensor) and len(getattr(a, f.name))})
