"""The tiny checkpoint of the weight-sync transport tests (helpers: sync_cases.py)."""

import pytest
from omegaconf import OmegaConf

from miles.config.schema import ModelCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from sync_cases import MODEL


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(MODEL)))
    return str(random_checkpoint(model, DEFAULT_ALPHABET, 0, tmp_path_factory.mktemp("ckpt")))
