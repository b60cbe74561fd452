"""LoRA runs through miles.orchestrate.run (in-process; the Ray sync path: tests/unit/transport/
test_lora_sync.py): a run stopped after 2 steps and resumed to 4 logs what a straight 4-step run
logs, and ends with the same merged checkpoint and PEFT adapter, bit for bit."""

import pytest

from runs import TINY, file_digest, journal_metrics, run_inprocess, without_timing

pytestmark = pytest.mark.slow

LORA = [*TINY, "trainer.lora.rank=8", "trainer.lr=1e-2"]


def test_lora_resume_equals_a_straight_run(tmp_path, monkeypatch, compose):
    monkeypatch.chdir(tmp_path)
    run_inprocess(compose, [*LORA, "steps=4"], tmp_path / "straight")
    ckpt = tmp_path / "ckpt"
    run_inprocess(compose, [*LORA, "steps=2", f"checkpoint.dir={ckpt}"], tmp_path / "first")
    assert (ckpt / "step_000002/adapter/adapter_model.safetensors").is_file()
    run_inprocess(compose, [*LORA, "steps=4", f"checkpoint.dir={ckpt}"], tmp_path / "second")

    straight = without_timing(journal_metrics(tmp_path / "straight"))
    first, second = (without_timing(journal_metrics(tmp_path / d)) for d in ("first", "second"))
    stitched = {**first, **second}
    stitched[2] = {k: v for k, v in stitched[2].items() if k != "final/objective"}
    assert stitched == straight
    assert straight[4]["train/entropy"] != straight[1]["train/entropy"]  # the adapters moved the policy
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        assert file_digest(tmp_path / "second/checkpoint" / name) == file_digest(tmp_path / "straight/checkpoint" / name)
