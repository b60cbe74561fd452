"""Fixtures of the trainer tests: one tiny random checkpoint and a real rollout batch from it."""

import pytest
from grpo_batches import grpo_batch

from miles.config.schema import ModelCfg
from miles.orchestrate.checkpoints import random_checkpoint


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
    """16 real samples (4 prompts x 4), rewards 1 on every third, GRPO advantages."""
    return grpo_batch(ckpt)
