"""PPO with several LoRA adapters: a critic per adapter (miles.trainer.critic.Critics). Each sample is
scored by its adapter's critic, each critic trains on its own samples only (as a one-critic step on
those samples would train it), per-adapter metrics, a checkpoint file per critic, and GAE's
whitening per adapter."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from miles.algo.advantages import masked_whiten
from miles.config.schema import AlgoCfg, AlgoName, CriticCfg, PrecisionCfg, RolloutCfg, RunCfg, TrainerCfg
from miles.orchestrate.handles import LocalHandle
from miles.orchestrate.resume import load_component_state, save_component_state
from miles.orchestrate.returns import make_train_batch
from miles.rollout.native import NativeEngine
from miles.trainer.critic import Critics, TorchCritic
from miles.trainer.packing import select
from miles.types import build_train_batch

FP32 = PrecisionCfg(name="fp32")
ROUTES = [0, 1, 1, 0, 0, 0, 1, 1]  # each sample's adapter: "a" (0) or "b" (1)


@pytest.fixture(scope="module")
def samples(ckpt):
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), seed=0)
    out = engine.generate(["1+2=", "33+4="], ["3", "37"], n=4)
    for s, adapter, reward in zip(out, ROUTES, [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]):
        s.adapter, s.reward = adapter, reward
    return out


@pytest.fixture(scope="module")
def batch(samples):
    """Returns 1 on every response token, rollout-time values 0."""
    b = build_train_batch(samples, torch.zeros(len(samples)), 0)
    b.values, b.returns = torch.zeros_like(b.loss_mask), b.loss_mask.clone()
    return b


def args(ckpt, lr=1e-2):
    return ckpt, CriticCfg(lr=lr), TrainerCfg(global_batch_size=8, micro_batch_size=4), FP32


def rows(adapter: int) -> torch.Tensor:
    return torch.tensor([i for i, k in enumerate(ROUTES) if k == adapter])


def weights(critic: TorchCritic) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in critic.model.state_dict().items()}


def test_each_critic_trains_on_its_own_samples_as_one_critic_would(ckpt, batch):
    critics = Critics(["a", "b"], *args(ckpt))
    metrics = critics.train(batch)
    for adapter, name in enumerate("ab"):
        alone = TorchCritic(*args(ckpt))
        own = alone.train(select(batch, rows(adapter)))
        assert all(torch.equal(v, alone.model.state_dict()[k]) for k, v in weights(critics.parts[name]).items())
        for key, value in own.items():  # critic/value_loss/a ... as the one critic logs them
            assert metrics[f"{key}/{name}"] == value
    # V == old V == 0 against returns 1: 0.5 for each adapter and overall; nothing clipped yet
    assert metrics["critic/value_loss/a"] == pytest.approx(0.5) and metrics["critic/value_loss"] == pytest.approx(0.5)
    tokens = [float(batch.loss_mask[rows(k)].sum()) for k in (0, 1)]
    want = (metrics["critic/grad_norm/a"] * tokens[0] + metrics["critic/grad_norm/b"] * tokens[1]) / sum(tokens)
    assert metrics["critic/grad_norm"] == pytest.approx(want) and metrics["critic/grad_norm/a"] > 0
    assert metrics["critic/value_mean"] == 0.0 and metrics["critic/explained_var"] == 0.0


def test_a_critic_without_samples_is_left_as_it_was(ckpt, batch):
    critics = Critics(["a", "b"], *args(ckpt))
    critics.train(batch)
    b_before = weights(critics.parts["b"])
    b_state = {k: v["step"].clone() for k, v in critics.parts["b"].optimizer.state.items()}
    metrics = critics.train(select(batch, rows(0)))  # "a" samples only
    assert all(torch.equal(v, critics.parts["b"].model.state_dict()[k]) for k, v in b_before.items())
    assert {k: v["step"] for k, v in critics.parts["b"].optimizer.state.items()} == b_state
    assert not any(k.endswith("/b") for k in metrics) and "critic/value_loss/a" in metrics


def test_an_adapter_with_fewer_samples_than_optimizer_steps(ckpt, batch):
    """algo.num_steps_per_rollout=2 and one "b" sample in the step: "b"'s critic takes one step."""
    critics = Critics(["a", "b"], *args(ckpt), num_steps_per_rollout=2)
    critics.train(select(batch, torch.tensor([0, 1, 3, 4, 5])))  # a, b, a, a, a
    assert [{int(v["step"]) for v in critics.parts[n].optimizer.state.values()} for n in "ab"] == [{2}, {1}]


def test_values_come_from_each_samples_critic(ckpt, batch):
    critics = Critics(["a", "b"], *args(ckpt, lr=5e-2))
    critics.train(select(batch, rows(1)))  # "b" learns returns 1; "a" still predicts 0
    values = critics.values(batch)
    assert torch.equal(values[rows(0)], torch.zeros_like(values[rows(0)]))
    b_values = critics.parts["b"].values(select(batch, rows(1)))
    torch.testing.assert_close(values[rows(1)], b_values, rtol=0, atol=1e-6)
    assert (values[rows(1)][batch.loss_mask[rows(1)] > 0] > 0.1).all()
    with pytest.raises(ValueError, match="does not name each sample's adapter"):
        critics.values(replace(batch, adapter_ids=torch.zeros(0, dtype=torch.long)))


def test_gae_takes_each_adapters_values_and_whitens_each_alone(ckpt, samples):
    critics = Critics(["a", "b"], *args(ckpt, lr=5e-2))
    fitted = build_train_batch(samples, torch.zeros(len(samples)), 0)
    fitted.values, fitted.returns = torch.zeros_like(fitted.loss_mask), fitted.loss_mask.clone()
    critics.train(select(fitted, rows(1)))
    ctx = SimpleNamespace(critic=LocalHandle(critics), tokenizer=SimpleNamespace(pad_id=0))
    cfg = RunCfg(algo=AlgoCfg(name=AlgoName.ppo, advantage="gae", gamma=1.0, lam=1.0))
    batch, _ = make_train_batch(ctx, cfg, samples)
    torch.testing.assert_close(batch.values, critics.values(batch), rtol=0, atol=0)
    assert batch.values[rows(1)].abs().sum() > 0 and batch.values[rows(0)].abs().sum() == 0
    raw = batch.returns - batch.values  # gamma = lam = 1: A = R - V
    for adapter in (0, 1):
        mine, mask = rows(adapter), batch.loss_mask[rows(adapter)]
        torch.testing.assert_close(batch.advantages[mine], masked_whiten(raw[mine], mask))


def test_checkpoint_holds_a_file_per_critic(ckpt, batch, tmp_path):
    critics = Critics(["a", "b"], *args(ckpt))
    critics.train(batch)
    save_component_state(critics, str(tmp_path), "critic")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["critic-a.pt", "critic-b.pt"]
    fresh = Critics(["a", "b"], *args(ckpt))
    load_component_state(fresh, str(tmp_path), "critic")
    for name in "ab":
        assert all(torch.equal(v, fresh.parts[name].model.state_dict()[k])
                   for k, v in weights(critics.parts[name]).items())
    # the next step from the restored state equals the next step of the saved one
    assert fresh.train(batch) == critics.train(batch)
