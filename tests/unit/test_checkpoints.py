"""The OPD teacher is resolved only with distillation on, and must share the student's vocabulary (and, for a
vision-language student, have a vision tower that reads the same pixel values)."""

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


def test_a_vision_language_students_teacher_reads_its_images(tmp_path):
    import json
    import shutil
    from pathlib import Path

    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[2] / "conf" / "model" / "qwen2_5_vl_tiny.yaml"
    vlm = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(conf)))
    student = random_checkpoint(vlm, "0123456789+=", 0, tmp_path / "student", chat=True)
    teacher = random_checkpoint(vlm, "0123456789+=", 1, tmp_path / "teacher", chat=True)
    assert teacher_checkpoint(cfg(opd_kl_coef=1.0, teacher_checkpoint=str(teacher)), student) == teacher
    text = Path(shutil.copytree(teacher, tmp_path / "text"))  # the same tokenizer, no vision tower
    config = json.loads((text / "config.json").read_text())
    del config["vision_config"]
    (text / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="has no vision tower"):
        teacher_checkpoint(cfg(opd_kl_coef=1.0, teacher_checkpoint=str(text)), student)
    other = Path(shutil.copytree(teacher, tmp_path / "other"))  # another image processing
    processor = json.loads((other / "preprocessor_config.json").read_text())
    processor["max_pixels"] = processor.get("max_pixels", 0) * 2 + 1
    (other / "preprocessor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ConfigError, match="processes images otherwise than the student"):
        teacher_checkpoint(cfg(opd_kl_coef=1.0, teacher_checkpoint=str(other)), student)
