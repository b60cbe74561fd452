"""The typed currency between components: what rollout produces and what the trainer consumes."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class FinishReason(str, Enum):
    stop = "stop"  # an eos or stop token was sampled
    length = "length"  # rollout.max_new_tokens reached


@dataclass
class Sample:
    """One response to one prompt. `group` ties the n samples of one prompt together."""

    prompt: str
    label: str
    prompt_ids: list[int]
    response_ids: list[int]  # includes the stop token when one was sampled
    rollout_logprobs: list[float]  # log-prob of each response token under the engine, same length
    response: str = ""  # decoded response without special tokens
    finish_reason: FinishReason = FinishReason.length
    group: int = 0
    reward: float = 0.0
    # Multi-turn: 1 for each response token the model generated, 0 for tool observations it was
    # given (no loss, no advantage, rollout log-prob 0). Empty: every token is the model's.
    response_mask: list[int] = field(default_factory=list)
    # What the reward function gets as keyword info besides the prompt: the record's other fields
    # and, multi-turn, "trajectory" (the conversation as role / content messages).
    info: dict = field(default_factory=dict)


@dataclass
class TrainBatch:
    """Right-padded token sequences of prompt + response, aligned for next-token prediction.

    Position t of the [N, T-1] tensors scores the prediction of tokens[:, t + 1].
    """

    tokens: torch.Tensor  # [N, T] long
    loss_mask: torch.Tensor  # [N, T-1] float, 1 where tokens[:, t+1] is a response token
    advantages: torch.Tensor  # [N, T-1] float, per-sequence advantage on its response tokens
    rollout_logprobs: torch.Tensor  # [N, T-1] float, engine log-probs on response tokens (0 elsewhere)
    rewards: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [N]
    # PPO only (empty otherwise): the critic's values at rollout time and its GAE targets, [N, T-1].
    values: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    returns: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def slice(self, start: int, end: int) -> "TrainBatch":
        def rows(t: torch.Tensor) -> torch.Tensor:
            return t[start:end] if len(t) else t  # optional fields stay empty

        return TrainBatch(
            tokens=self.tokens[start:end],
            loss_mask=self.loss_mask[start:end],
            advantages=self.advantages[start:end],
            rollout_logprobs=self.rollout_logprobs[start:end],
            rewards=rows(self.rewards),
            values=rows(self.values),
            returns=rows(self.returns),
        )


def build_train_batch(samples: list[Sample], advantages: torch.Tensor, pad_id: int) -> TrainBatch:
    """Pack samples into a right-padded TrainBatch. `advantages` is per sample, shape [N]."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    n, width = len(samples), max(lengths)
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros(n, width - 1)
    rollout_lp = torch.zeros(n, width - 1)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        # The response token at sequence index p + j is predicted at position p + j - 1.
        mask[i, p - 1 : p - 1 + r] = torch.tensor(s.response_mask, dtype=mask.dtype) if s.response_mask else 1.0
        if s.rollout_logprobs:
            rollout_lp[i, p - 1 : p - 1 + r] = torch.tensor(s.rollout_logprobs)
    adv = advantages.to(torch.float32).unsqueeze(1) * mask
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return TrainBatch(tokens=tokens, loss_mask=mask, advantages=adv, rollout_logprobs=rollout_lp, rewards=rewards)
