"""LoRA on Llama 4's transposed stacked experts (model=llama4_tiny, target_modules [..., experts])
through miles.orchestrate.run, in-process: the torch trainer trains the expert adapters, the native
engine applies the synced ones unmerged or merged into its expert stacks, its log-probs stay the
trainer's, and the checkpoint holds a PEFT adapter whose `target_parameters` are transformers'
`feed_forward.experts` stacks. Unit-level checks (PEFT on transformers' Llama 4, by hand, merged):
tests/unit/models/test_lora_llama4_experts.py."""

import json

import pytest
from safetensors.torch import load_file

from runs import TINY, journal_metrics, run_inprocess

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine_side", [[], ["trainer.lora.merge_in_engine=true"]], ids=["unmerged", "merged"])
def test_llama4_expert_adapters_train_sync_and_save(tmp_path, monkeypatch, compose, engine_side):
    monkeypatch.chdir(tmp_path)
    run_inprocess(compose, [*TINY, "model=llama4_tiny", "trainer.lora.rank=4", "trainer.lr=1e-2", "steps=2",
                            "trainer.lora.target_modules=[q_proj,v_proj,experts]", *engine_side], tmp_path / "run")
    metrics = journal_metrics(tmp_path / "run")
    # Step 2's samples come from the adapters step 1 trained: the engine applied them.
    assert all(metrics[step]["mismatch/logprob_abs_diff"] < 1e-6 for step in (1, 2)), metrics
    assert metrics[2]["train/entropy"] != metrics[1]["train/entropy"]
    adapter = tmp_path / "run/checkpoint/adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == [f"model.layers.{i}.feed_forward.experts.{t}"
                                                   for i in (1, 3) for t in ("down_proj", "gate_up_proj")]
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    # Transposed stacks: B is the input side, so both factors of a trained pair moved off their init.
    expert_b = [t for k, t in tensors.items() if k.endswith("feed_forward.experts.lora_B.weight")]
    assert expert_b and all(t.abs().sum() > 0 for t in expert_b)
