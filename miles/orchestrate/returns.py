"""From scored samples to a TrainBatch: reward clipping, KL in the reward, advantages.

Sequence-level estimators (`algo.advantage` in ADVANTAGES) turn one reward per response into one
advantage per response. Token-level ones (GAE, in TOKEN_ADVANTAGES) put the reward on the response's
last token and need the critic's values; their advantages are whitened over the batch and their
returns become the critic's targets. With `algo.kl_in_reward` the trainer's per-token KL to the
reference is charged to the reward instead of the loss: per token for GAE, summed over the response
for sequence estimators (as REINFORCE-style methods do). Several LoRA adapters: a sequence estimator
runs on each adapter's samples alone, so no batch statistic (REINFORCE++'s whitening) mixes them;
GAE takes each sample's values from its adapter's critic (miles.trainer.critic.Critics) and whitens
each adapter's advantages on their own.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from miles.algo.advantages import clip_rewards, masked_whiten, terminal_rewards
from miles.algo.registry import ADVANTAGES, TOKEN_ADVANTAGES, get
from miles.types import Sample, TrainBatch, build_train_batch


def make_train_batch(ctx, cfg, samples: list[Sample]) -> tuple[TrainBatch, dict[str, float]]:
    """`ctx` is the loop's LoopContext (trainer and, for GAE, critic handles), `cfg` the RunCfg."""
    a = cfg.algo
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    if a.reward_clip is not None:
        rewards = clip_rewards(rewards, -a.reward_clip, a.reward_clip)
    batch = build_train_batch(samples, torch.zeros(len(samples)), ctx.tokenizer.pad_id or 0)
    mask = batch.loss_mask
    metrics: dict[str, float] = {}
    kl = None
    if a.kl_in_reward:
        kl = ctx.trainer.call("kl_to_ref", batch)
        metrics["train/kl_ref"] = float(kl.sum() / mask.sum().clamp(min=1))

    if a.advantage in TOKEN_ADVANTAGES:
        values = ctx.critic.call("values", batch)
        token_rewards = terminal_rewards(rewards, mask)
        if kl is not None:
            token_rewards = token_rewards - a.kl_coef * kl
        advantages, returns = get(TOKEN_ADVANTAGES, "advantage estimator", a.advantage)(
            token_rewards, values, mask, a.gamma, a.lam
        )
        return replace(batch, advantages=_whiten(advantages, mask, batch.adapter_ids), values=values,
                       returns=returns), metrics

    if kl is not None:
        rewards = rewards - a.kl_coef * kl.sum(-1)
    groups = torch.tensor([s.group for s in samples])
    estimator = get(ADVANTAGES, "advantage estimator", a.advantage)
    if len(batch.adapter_ids):  # each adapter's samples are a batch of their own
        advantages = torch.zeros(len(samples))
        for adapter in batch.adapter_ids.unique().tolist():
            rows = (batch.adapter_ids == adapter).nonzero().squeeze(1)
            advantages[rows] = estimator(rewards[rows], groups[rows], norm_by_std=a.norm_adv_by_std)
    else:
        advantages = estimator(rewards, groups, norm_by_std=a.norm_adv_by_std)
    return replace(batch, advantages=advantages.unsqueeze(1) * mask), metrics


def _whiten(advantages: torch.Tensor, mask: torch.Tensor, adapter_ids: torch.Tensor) -> torch.Tensor:
    """GAE's batch whitening; with several adapters over each adapter's samples alone."""
    if not len(adapter_ids):
        return masked_whiten(advantages, mask)
    out = torch.zeros_like(advantages)
    for adapter in adapter_ids.unique().tolist():
        rows = (adapter_ids == adapter).nonzero().squeeze(1)
        out[rows] = masked_whiten(advantages[rows], mask[rows])
    return out
