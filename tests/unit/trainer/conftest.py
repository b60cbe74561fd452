"""Fixtures of the trainer tests: one tiny random checkpoint and a real rollout batch from it."""

import pytest
import torch

from miles.algo.registry import ADVANTAGES, get
from miles.config.schema import ModelCfg, RolloutCfg
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.types import build_train_batch


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = ModelCfg(name="t", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, max_position_embeddings=64)
    return str(random_checkpoint(model, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("ck")))


@pytest.fixture(scope="module")
def draft_ckpt(ckpt, tmp_path_factory):
    """A smaller model than `ckpt` with its vocabulary (a speculative draft model)."""
    from trainer_contract import write_draft_checkpoint

    return write_draft_checkpoint(ckpt, tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def rollout_batch(ckpt):
    """16 real samples (4 prompts x 4, 1-5 response tokens), rewards 1 on every third, GRPO advantages."""
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), seed=0)
    samples = engine.generate(["1+2=", "33+4=", "50+50=", "7+8="], ["3", "37", "100", "15"], n=4)
    rewards = torch.tensor([float(i % 3 == 0) for i in range(16)])
    for s, r in zip(samples, rewards):
        s.reward = float(r)
    adv = get(ADVANTAGES, "a", "grpo")(rewards, torch.tensor([s.group for s in samples]))
    return build_train_batch(samples, adv, engine.pad_id)
