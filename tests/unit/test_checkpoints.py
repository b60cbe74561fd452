"""The OPD teacher is resolved only with distillation on, and must share the student's vocabulary."""

import pytest

from miles.config.schema import AlgoCfg, AlgoName, ModelCfg, RunCfg
from miles.config.errors import ConfigError
from miles.orchestrate.checkpoints import random_checkpoint, teacher_checkpoint

MODEL = ModelCfg(name="t", hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                 head_dim=8, max_position_embeddings=32)


def cfg(**algo):
    return RunCfg(algo=AlgoCfg(name=AlgoName.opd, **algo))


def test_teacher_checkpoint(tmp_path):
    student = random_checkpoint(MODEL, "0123456789+=", 0, tmp_path / "student")
    same_vocab = random_checkpoint(MODEL, "0123456789+=", 1, tmp_path / "same")
    other_vocab = random_checkpoint(MODEL, "0123456789-=", 1, tmp_path / "other")
    assert teacher_checkpoint(cfg(opd_kl_coef=0.0, teacher_checkpoint=str(same_vocab)), student) is None
    assert teacher_checkpoint(cfg(opd_kl_coef=1.0, teacher_checkpoint=str(same_vocab)), student) == same_vocab
    with pytest.raises(ConfigError, match="has another vocabulary than the student"):
        teacher_checkpoint(cfg(opd_kl_coef=1.0, teacher_checkpoint=str(other_vocab)), student)
