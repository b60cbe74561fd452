"""PPO critic: value-head shape and init, the value loss it minimizes, k passes per batch, metrics."""

import pytest
import torch

from miles.config.schema import CriticCfg, PrecisionCfg, RolloutCfg, TrainerCfg
from miles.rollout.native import NativeEngine
from miles.trainer.critic import TorchCritic
from miles.types import build_train_batch

FP32 = PrecisionCfg(name="fp32")


@pytest.fixture(scope="module")
def batch(ckpt):
    """8 real samples with returns 1 on every response token and rollout-time values 0."""
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), seed=0)
    samples = engine.generate(["1+2=", "33+4="], ["3", "37"], n=4)
    b = build_train_batch(samples, torch.zeros(8), engine.pad_id)
    b.values, b.returns = torch.zeros_like(b.loss_mask), b.loss_mask.clone()
    return b


def critic(ckpt, **cfg):
    return TorchCritic(ckpt, CriticCfg(**cfg), TrainerCfg(global_batch_size=8, micro_batch_size=4), FP32)


def test_fresh_value_head_predicts_zero(ckpt, batch):
    values = critic(ckpt).values(batch)
    assert values.shape == batch.loss_mask.shape and torch.equal(values, torch.zeros_like(values))


def test_critic_fits_fixed_returns(ckpt, batch):
    c = critic(ckpt, lr=1e-2)
    first = c.train(batch)
    # V == old V == 0 on the only update: no clipping, loss = 0.5 * mean((0 - 1)^2), nothing explained
    assert first["critic/value_loss"] == pytest.approx(0.5) and first["critic/vf_clipfrac"] == 0.0
    assert first["critic/value_mean"] == 0.0 and first["critic/explained_var"] == 0.0
    for _ in range(20):
        b = batch.slice(0, 8)
        b.values = c.values(batch)
        last = c.train(b)
    assert last["critic/value_loss"] < 0.05 and last["critic/value_mean"] > 0.7


def test_k_passes_per_batch(ckpt, batch):
    # lr 0.5 moves the head's bias by ~0.5 in one Adam step, beyond the 0.2 clip: the second pass clips.
    c = critic(ckpt, lr=0.5, updates_per_step=2)
    m = c.train(batch)
    steps = {int(s["step"]) for s in c.optimizer.state.values()}
    assert steps == {2} and m["critic/vf_clipfrac"] > 0
