"""Scored samples -> TrainBatch: reward clipping, KL in the reward, sequence vs GAE advantages.
Stub trainer and critic behind in-process handles return fixed per-token KL and values."""

import math
from types import SimpleNamespace

import torch

from miles.config.schema import AlgoCfg, AlgoName, RunCfg
from miles.orchestrate.handles import LocalHandle
from miles.orchestrate.returns import make_train_batch
from miles.types import Sample

# Two prompts x 2 samples; responses of 2 tokens after a 2-token prompt -> loss positions 1, 2.
REWARDS = [1.0, 0.0, 5.0, 0.0]


def samples():
    return [Sample(prompt="", label="", prompt_ids=[1, 2], response_ids=[3, 4], rollout_logprobs=[0.0, 0.0],
                   group=i // 2, reward=r) for i, r in enumerate(REWARDS)]


class Stub:
    def kl_to_ref(self, batch):
        return 0.25 * batch.loss_mask  # 0.25 per response token

    def values(self, batch):
        return 0.5 * batch.loss_mask


def ctx():
    stub = LocalHandle(Stub())
    return SimpleNamespace(trainer=stub, critic=stub, tokenizer=SimpleNamespace(pad_id=0))


def cfg(**algo):
    return RunCfg(algo=AlgoCfg(name=AlgoName.grpo, **algo))


def test_sequence_advantages_with_reward_clip():
    batch, metrics = make_train_batch(ctx(), cfg(reward_clip=2.0, norm_adv_by_std=False), samples())
    # rewards clipped to 1, 0, 2, 0 -> group-mean baseline 0.5, -0.5, 1, -1 on both response tokens
    expected = torch.tensor([0.5, -0.5, 1.0, -1.0])[:, None] * batch.loss_mask
    assert torch.equal(batch.advantages, expected) and metrics == {}


def test_kl_in_reward_is_summed_over_the_response():
    batch, metrics = make_train_batch(ctx(), cfg(kl_coef=0.4, kl_in_reward=True, advantage="rloo"), samples())
    # every response pays 0.4 * (0.25 + 0.25) = 0.2: a constant shift, so RLOO advantages are unchanged
    expected = torch.tensor([1.0, -1.0, 5.0, -5.0])[:, None] * batch.loss_mask
    torch.testing.assert_close(batch.advantages, expected)
    assert metrics == {"train/kl_ref": 0.25}


def test_gae_uses_the_critic_and_whitens():
    batch, _ = make_train_batch(ctx(), cfg(advantage="gae", gamma=1.0, lam=1.0, kl_coef=0.4, kl_in_reward=True),
                                samples())
    mask = batch.loss_mask
    # token rewards: -0.1 (KL) on each token, + the reward on the last; gamma = lam = 1: return = sum of
    # rewards from t on, A = return - V (V = 0.5)
    returns = torch.tensor([[0.8, 0.9], [-0.2, -0.1], [4.8, 4.9], [-0.2, -0.1]])
    torch.testing.assert_close(batch.returns[:, 1:3], returns)
    torch.testing.assert_close(batch.values, 0.5 * mask)
    raw = returns - 0.5
    # unbiased variance over the 8 response tokens, as verl whitens (masked_whiten)
    whitened = (raw - raw.mean()) / math.sqrt(((raw - raw.mean()) ** 2).sum() / 7)
    torch.testing.assert_close(batch.advantages[:, 1:3], whitened)
    assert (batch.advantages[mask == 0] == 0).all()


def test_batch_whitening_stays_within_each_lora_adapter():
    """Several LoRA adapters: REINFORCE++ whitens each adapter's rewards on their own, so the same
    rewards give the same advantages whatever the other adapter's samples scored."""
    routed = samples()
    for s, adapter in zip(routed, [0, 0, 1, 1]):
        s.adapter = adapter
    batch, _ = make_train_batch(ctx(), cfg(advantage="reinforce_pp"), routed)
    # per adapter: rewards (1, 0) and (5, 0), each whitened: (r - mean) / (std + eps), std of 2 values
    for pair, (hi, lo) in ((slice(0, 2), (1.0, 0.0)), (slice(2, 4), (5.0, 0.0))):
        mean, std = (hi + lo) / 2, abs(hi - lo) / math.sqrt(2)
        want = torch.tensor([(hi - mean) / (std + 1e-6), (lo - mean) / (std + 1e-6)])
        torch.testing.assert_close(batch.advantages[pair, -1], want)
    assert torch.equal(batch.adapter_ids, torch.tensor([0, 0, 1, 1]))
