"""Fixtures shared by the native engine's test files."""

import pytest

from miles.config.schema import ModelCfg
from miles.orchestrate.checkpoints import random_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random 2-layer GQA checkpoint of the arithmetic alphabet (files that need another define their own)."""
    model = ModelCfg(name="t", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, max_position_embeddings=64)
    return str(random_checkpoint(model, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("ck")))
