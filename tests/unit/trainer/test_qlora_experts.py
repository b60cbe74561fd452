"""QLoRA on a MoE model (trainer.lora with precision=fp8 / int4_qat): the stacked experts held in the
rollout's quantized format too (miles/models/frozen_experts.py), in-process against real references:

- a fresh adapter gives the recipe's own (non-LoRA) log-probs bit for bit, expert adapters or not;
- a step moves the (expert) adapters as LoRA over the recipe's fp32 masters does, bit for bit;
- the experts are held as FP8 codes / packed INT4 + fp32 scales (bytes by hand), the engine holds
  the same codes and scales, and they never change;
- a state dict shows the dense dequantized experts (resume and export), another base is refused;
- the planner counts the experts at their quantized bytes.
"""

import math

import pytest
import torch

from miles.config.schema import LoRACfg, ModelCfg, RolloutCfg
from miles.models.config import MoEConfig
from miles.models.frozen_experts import FrozenQuantExperts
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.trainer import lora as lora_side

from test_qlora import LABELS, PROMPTS, batch_of, dense_base_attach, recipe, trainer

EXPERT_LORA = LoRACfg(rank=4, alpha=8.0, target_modules=["q_proj", "experts"])
E, H, I = 4, 128, 128  # experts, hidden, expert width: whole 128-blocks and INT4 groups
MODEL = ModelCfg(name="m", family="qwen3_moe", hidden_size=H, intermediate_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, max_position_embeddings=64,
                 moe=MoEConfig(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=I))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(random_checkpoint(MODEL, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("qlora_moe")))


@pytest.fixture(scope="module")
def batch(ckpt):
    return batch_of(NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), seed=0), PROMPTS[:2], LABELS[:2])


@pytest.mark.parametrize("quant", ["fp8", "fp8_w8a16", "int4"])
@pytest.mark.parametrize("lora", [EXPERT_LORA, LoRACfg(rank=4, alpha=8.0)], ids=["expert-adapters", "projections"])
def test_fresh_adapter_gives_the_recipes_logprobs_exactly(ckpt, batch, quant, lora):
    t = trainer(ckpt, recipe(quant), lora=lora)
    assert all(isinstance(layer.mlp.experts, FrozenQuantExperts) for layer in t.model.layers)
    assert torch.equal(t.logprobs(batch), trainer(ckpt, recipe(quant), lora=LoRACfg()).logprobs(batch))


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_a_step_moves_the_adapters_as_lora_over_the_dense_masters(ckpt, batch, quant, monkeypatch):
    q = trainer(ckpt, recipe(quant), lora=EXPERT_LORA, optimizer="sgd")
    with monkeypatch.context() as m:
        m.setattr(lora_side, "attach", dense_base_attach)
        dense = trainer(ckpt, recipe(quant), lora=EXPERT_LORA, optimizer="sgd")
    assert not isinstance(dense.model.layers[0].mlp.experts, FrozenQuantExperts)
    mq, md = q.train_rl(batch), dense.train_rl(batch)
    assert mq["train/ppo_kl"] == 0.0 and mq["train/grad_norm"] == md["train/grad_norm"] > 0
    assert all(torch.equal(q.lora.tensors()[name], t) for name, t in dense.lora.tensors().items())
    assert any(t.abs().sum() > 0 for name, t in q.lora.tensors().items() if ".experts." in name and "lora_B" in name)


@pytest.mark.parametrize("quant,expected_bytes", [
    ("fp8", E * (2 * I * H + H * I) + 4 * E * (2 * 1 + 1)),  # 1 byte a weight + a scale per 128x128 block
    ("int4", E * (2 * I * H + H * I) // 2 + 4 * E * (2 * I + H) * 1 + 2 * 3 * 8),  # + group scales, shapes
])
def test_experts_held_quantized_and_the_engine_holds_their_values(ckpt, batch, quant, expected_bytes):
    t = trainer(ckpt, recipe(quant), lora=EXPERT_LORA)
    experts = t.model.layers[0].mlp.experts
    assert [n for n, _ in experts.named_parameters()] == []
    assert experts.held_bytes() == expected_bytes
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), seed=0, precision=recipe(quant, "fp32"))
    held = engine.model.layers[0].mlp.experts  # the engine holds the same codes and scales
    assert all(torch.equal(getattr(held, n), getattr(experts, n)) for n in held.buffer_names())
    assert torch.equal(held.expert_weight("gate_up_proj", 1), experts.dequantized("gate_up_proj")[1])
    before = {k: v.clone() for k, v in experts.state_dict().items()}
    t.train_rl(batch)
    assert all(torch.equal(experts.state_dict()[k], v) for k, v in before.items())


def test_state_dict_is_dense_and_another_base_is_refused(ckpt, batch, tmp_path):
    t = trainer(ckpt, recipe("fp8"), lora=EXPERT_LORA)
    state = t.model.layers[0].mlp.experts.state_dict()
    assert set(state) == {"gate_up_proj", "down_proj"} and state["gate_up_proj"].shape == (E, 2 * I, H)
    t.train_rl(batch)
    t.save_state(str(tmp_path / "state"))
    again = trainer(ckpt, recipe("fp8"), lora=EXPERT_LORA)
    again.load_state(str(tmp_path / "state"))
    assert torch.equal(again.logprobs(batch), t.logprobs(batch))
    other = {**state, "gate_up_proj": state["gate_up_proj"] + 1}
    with pytest.raises(RuntimeError, match="differs from the frozen experts"):
        again.model.layers[0].mlp.experts.load_state_dict(other)


def test_planner_counts_the_experts_quantized():
    from miles.config.schema import PrecisionCfg, Quant
    from miles.hardware.lora_footprint import quantized_base

    arch = MODEL.arch(32)
    params, held = quantized_base(arch, PrecisionCfg(name="fp8", train_quant=Quant.fp8, rollout_quant=Quant.fp8))
    attention = 2 * (4 * 32 * H + 2 * 2 * 32 * H + H * 4 * 32)  # q, k, v, o of 2 layers
    experts = 2 * E * (2 * I * H + H * I)
    assert params == attention + experts
    assert held == params + 4 * (2 * (1 + 1 + 1 + 1) + 2 * E * (2 + 1))  # one fp32 scale per 128x128 block
    assert math.isclose(held / params, 1.0, rel_tol=1e-3)
