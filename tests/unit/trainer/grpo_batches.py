"""A real GRPO batch from a checkpoint, for the trainer tests (conftest.py's `rollout_batch`, and the
tests that need one of another model)."""

import torch

from miles.algo.registry import ADVANTAGES, get
from miles.config.schema import RolloutCfg
from miles.rollout.native import NativeEngine
from miles.types import build_train_batch


def grpo_batch(ckpt: str):
    """16 real samples of `ckpt` (4 prompts x 4, 1-5 response tokens), rewards 1 on every third, GRPO advantages."""
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), seed=0)
    samples = engine.generate(["1+2=", "33+4=", "50+50=", "7+8="], ["3", "37", "100", "15"], n=4)
    rewards = torch.tensor([float(i % 3 == 0) for i in range(16)])
    for s, r in zip(samples, rewards):
        s.reward = float(r)
    adv = get(ADVANTAGES, "a", "grpo")(rewards, torch.tensor([s.group for s in samples]))
    return build_train_batch(samples, adv, engine.pad_id)
