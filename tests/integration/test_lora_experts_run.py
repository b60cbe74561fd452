"""LoRA on a MoE model's stacked experts through miles.orchestrate.run (native engine; in-process, and
with the engine and trainer as Ray actors):
the engine applies the synced expert adapters, unmerged or merged into its expert tensors, or over
a base both sides hold in INT4 (QLoRA, fp32 compute: the trainer's experts held quantized); its log-probs stay the
trainer's, the adapters move the policy, and the checkpoint holds a PEFT adapter
with `target_parameters`."""

import json

import pytest
from safetensors.torch import load_file

from ray_runs import run_with
from runs import TINY, journal_metrics, run_inprocess

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine_side,ray", [
    ([], False), ([], True), (["trainer.lora.merge_in_engine=true"], False),
    (["precision=int4_qat", "precision.train_dtype=fp32", "precision.rollout_dtype=fp32"], False)],
    ids=["unmerged-in_process", "unmerged-ray", "merged-in_process", "qlora-int4-in_process"])  # in_process: out of the Ray group
def test_expert_adapters_train_sync_and_save(tmp_path, monkeypatch, compose, engine_side, ray):
    monkeypatch.chdir(tmp_path)
    overrides = [*TINY, "model=qwen3_moe_tiny", "trainer.lora.rank=4", "trainer.lr=1e-2", "steps=2",
                 "trainer.lora.target_modules=[q_proj,v_proj,experts]", *engine_side]
    run_with(compose, overrides, tmp_path / "run", ray)
    metrics = journal_metrics(tmp_path / "run")
    assert metrics[2]["mismatch/logprob_abs_diff"] < 1e-4  # the engine applied the synced expert adapters
    assert metrics[2]["train/entropy"] != metrics[1]["train/entropy"]
    adapter = tmp_path / "run/checkpoint/adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] and all(".mlp.experts." in p for p in config["target_parameters"])
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    expert_b = [t for k, t in tensors.items() if k.endswith("mlp.experts.lora_B.weight")]
    assert expert_b and all(t.abs().sum() > 0 for t in expert_b)  # trained: B left zero


@pytest.mark.no_ray
def test_two_adapters_over_the_experts(tmp_path, monkeypatch, compose):
    """Two adapters with expert adapters (the shipped two-task file): the engine routes each prompt's
    tokens through its adapter's experts as the trainer does, and each adapter trains."""
    from launch_cli import ROOT

    data = ROOT / "examples/data/two_tasks"
    monkeypatch.chdir(tmp_path)
    run_inprocess(compose, [*TINY, "model=qwen3_moe_tiny", "trainer.lora.rank=4", "trainer.lr=1e-2", "steps=2",
                            "trainer.lora.target_modules=[q_proj,experts]", "task.name=two_tasks", "task.kind=file",
                            f"task.train_file={data / 'train.jsonl'}", f"task.eval_file={data / 'test.jsonl'}",
                            "trainer.lora.adapters=[add,mul]", "trainer.lora.adapter_key=adapter"], tmp_path / "run")
    metrics = journal_metrics(tmp_path / "run")
    assert metrics[2]["mismatch/logprob_abs_diff"] < 1e-4
    assert any(f"train/grad_norm/{name}" in metrics[s] for s in (1, 2) for name in ("add", "mul"))
    for name in ("add", "mul"):
        config = json.loads((tmp_path / f"run/checkpoint/adapter/{name}/adapter_config.json").read_text())
        assert config["target_parameters"]
