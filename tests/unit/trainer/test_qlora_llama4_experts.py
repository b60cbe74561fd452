"""QLoRA on Llama 4 (trainer.lora with precision=fp8 / int4_qat, model=llama4_tiny): its transposed expert
stacks (gate_up_proj [E, H, 2I], down_proj [E, I, H], x @ W_e) held in the rollout's quantized format
(miles/models/frozen_experts.py, FrozenQuantLlama4Experts), in-process against real references:

- the held codes and scales are the engine's payload for those tensors, bit for bit (rollout_format of
  the checkpoint's stacks: FP8 blocks over the stored [H, 2I], INT4 groups along the stored last dim);
- a fresh adapter gives the recipe's own (non-LoRA) log-probs bit for bit, expert adapters or not;
- a step moves the (expert) adapters as LoRA over the recipe's fp32 masters does, bit for bit;
- bytes held by hand, the engine holds the same codes and scales, they never change, a resume loads
  them back and another base is refused;
- the planner counts them at their quantized bytes.
"""

import math

import pytest
import torch

from miles.config.schema import LoRACfg, PrecisionCfg, Quant, RolloutCfg
from miles.models import from_pretrained
from miles.models.frozen_experts import FrozenQuantLlama4Experts
from miles.orchestrate.checkpoints import random_checkpoint
from miles.precision.rollout_format import rollout_format
from miles.rollout.native import NativeEngine
from miles.trainer import lora as lora_side

from test_qlora import LABELS, PROMPTS, batch_of, dense_base_attach, recipe, trainer

EXPERT_LORA = LoRACfg(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "experts"])
E, H, I = 4, 128, 128  # llama4_tiny: experts, hidden, expert width (whole 128-blocks and INT4 groups)
MOE_LAYERS = (1, 3)
QUANT = {"fp8": "fp8", "fp8_w8a16": "fp8", "int4": "int4"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, compose):
    model = compose(["model=llama4_tiny"]).model
    return str(random_checkpoint(model, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("qlora_llama4")))


@pytest.fixture(scope="module")
def batch(ckpt):
    return batch_of(NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), seed=0), PROMPTS[:2], LABELS[:2])


def experts_of(t):
    return [t.model.layers[i].mlp.experts for i in MOE_LAYERS]


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_held_tensors_are_the_engines_payload(ckpt, quant):
    t = trainer(ckpt, recipe(quant), lora=EXPERT_LORA)
    dense = from_pretrained(ckpt).state_dict()
    for i, experts in zip(MOE_LAYERS, experts_of(t)):
        assert isinstance(experts, FrozenQuantLlama4Experts) and experts.is_transposed
        prefix = f"layers.{i}.mlp.experts."
        stacks = {name: dense[prefix + name] for name in ("gate_up_proj", "down_proj")}
        payload = rollout_format(stacks, QUANT[quant])
        held = dict(experts.named_buffers())
        assert sorted(held) == sorted(payload)
        assert all(held[k].dtype == v.dtype and torch.equal(held[k], v) for k, v in payload.items())
    if quant == "int4":  # groups along the stored last dim: 2I of gate_up_proj, as the engine is sent it
        assert tuple(experts.gate_up_proj_scale.shape) == (E, H, 2 * I // 128)


@pytest.mark.parametrize("quant", ["fp8", "fp8_w8a16", "int4"])
@pytest.mark.parametrize("lora", [EXPERT_LORA, LoRACfg(rank=4, alpha=8.0)], ids=["expert-adapters", "projections"])
def test_fresh_adapter_gives_the_recipes_logprobs_exactly(ckpt, batch, quant, lora):
    t = trainer(ckpt, recipe(quant), lora=lora)
    assert all(isinstance(experts, FrozenQuantLlama4Experts) for experts in experts_of(t))
    assert torch.equal(t.logprobs(batch), trainer(ckpt, recipe(quant), lora=LoRACfg()).logprobs(batch))


@pytest.mark.parametrize("quant", ["fp8", "fp8_w8a16", "int4"])
def test_a_step_moves_the_adapters_as_lora_over_the_dense_masters(ckpt, batch, quant, monkeypatch):
    q = trainer(ckpt, recipe(quant), lora=EXPERT_LORA, optimizer="sgd")
    with monkeypatch.context() as m:
        m.setattr(lora_side, "attach", dense_base_attach)
        dense = trainer(ckpt, recipe(quant), lora=EXPERT_LORA, optimizer="sgd")
    assert not any(isinstance(experts, FrozenQuantLlama4Experts) for experts in experts_of(dense))
    mq, md = q.train_rl(batch), dense.train_rl(batch)
    assert mq["train/ppo_kl"] == 0.0 and mq["train/grad_norm"] == md["train/grad_norm"] > 0
    assert all(torch.equal(q.lora.tensors()[name], t) for name, t in dense.lora.tensors().items())
    # Transposed stacks: B is the input side, so SGD's first step moves the experts' B off zero.
    assert any(t.abs().sum() > 0 for name, t in q.lora.tensors().items() if ".experts." in name and "lora_B" in name)
    assert torch.equal(q.logprobs(batch), dense.logprobs(batch))


@pytest.mark.parametrize("quant,expected_bytes", [
    ("fp8", E * (H * 2 * I + I * H) + 4 * E * (2 + 1)),  # 1 byte a weight + a scale per 128x128 block
    ("int4", E * (H * 2 * I + I * H) // 2 + 4 * E * (H * 2 + I * 1) + 2 * 3 * 8),  # + group scales, shapes
])
def test_experts_held_quantized_and_the_engine_holds_their_values(ckpt, batch, quant, expected_bytes):
    t = trainer(ckpt, recipe(quant), lora=EXPERT_LORA)
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), seed=0, precision=recipe(quant, "fp32"))
    for i, experts in zip(MOE_LAYERS, experts_of(t)):
        assert [n for n, _ in experts.named_parameters()] == []
        assert experts.held_bytes() == expected_bytes
        held = engine.model.layers[i].mlp.experts  # the engine holds the same codes and scales
        assert all(torch.equal(getattr(held, n), getattr(experts, n)) for n in held.buffer_names())
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(held.expert_weight(name, 1), experts.dequantized(name)[1])
    before = {k: v.clone() for k, v in experts_of(t)[0].state_dict().items()}
    t.train_rl(batch)
    assert all(torch.equal(experts_of(t)[0].state_dict()[k], v) for k, v in before.items())


def test_state_dict_is_dense_resume_is_exact_and_another_base_is_refused(ckpt, batch, tmp_path):
    t = trainer(ckpt, recipe("int4"), lora=EXPERT_LORA)
    state = experts_of(t)[0].state_dict()
    assert set(state) == {"gate_up_proj", "down_proj"} and state["gate_up_proj"].shape == (E, H, 2 * I)
    t.train_rl(batch)
    t.save_state(str(tmp_path / "state"))
    again = trainer(ckpt, recipe("int4"), lora=EXPERT_LORA)
    again.load_state(str(tmp_path / "state"))
    assert torch.equal(again.logprobs(batch), t.logprobs(batch))
    other = {**state, "down_proj": state["down_proj"] * 2}
    with pytest.raises(RuntimeError, match="differs from the frozen experts"):
        experts_of(again)[0].load_state_dict(other)


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_planner_counts_what_the_trainer_holds(ckpt, quant):
    """The planner's quantized base (a meta-device model) is the real trainer's: its projections'
    codes and scales plus the Llama 4 experts' (less their INT4 `_shape` records, metadata)."""
    from miles.hardware.lora_footprint import quantized_base
    from miles.precision.qlora import FrozenQuantLinear

    t = trainer(ckpt, recipe(quant), lora=EXPERT_LORA)
    params, held = quantized_base(t.model.config, PrecisionCfg(name=quant, train_quant=Quant(quant),
                                                               rollout_quant=Quant(quant)))
    linears = [m for m in t.model.modules() if isinstance(m, FrozenQuantLinear)]
    experts = experts_of(t)
    shape_records = sum(b.numel() * 8 for m in experts for n, b in m.named_buffers() if n.endswith("_shape"))
    assert held == sum(m.held_bytes() for m in linears + experts) - shape_records
    expert_params = len(MOE_LAYERS) * E * (H * 2 * I + I * H)
    assert params == sum(m.in_features * m.out_features for m in linears) + expert_params
    assert math.isclose(held / params, 1.0 if quant == "fp8" else 0.53, rel_tol=0.02)
