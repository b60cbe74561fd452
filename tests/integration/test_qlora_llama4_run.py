"""QLoRA on Llama 4 through miles.orchestrate.run, in-process (model=llama4_tiny, precision=int4_qat / fp8,
adapters on q / v and the transposed expert stacks): the trainer holds the experts quantized
(FrozenQuantLlama4Experts, the engine's payload), the checked sync carries the adapters, the engine's
log-probs stay within the recipe's mismatch (the same runs with Llama 4's experts dense and
fake-quantized per forward measured 1.5e-3 under int4_qat), and the run ends with its merged export
and a PEFT adapter naming transformers' expert stacks. Unit-level checks:
tests/unit/trainer/test_qlora_llama4_experts.py."""

import json

import pytest
import torch
from safetensors.torch import load_file

from miles.models.frozen_experts import FrozenQuantLlama4Experts
from runs import TINY, journal_metrics, run_inprocess

pytestmark = pytest.mark.slow

# Measured (2 steps, random init, bf16 compute, 2026-12-04): see docs/lora.md's QLoRA section.
BOUND = {"int4_qat": 5e-3, "fp8": 2e-2}


@pytest.mark.parametrize("recipe", sorted(BOUND))
def test_qlora_llama4_experts_run(tmp_path, monkeypatch, compose, recipe):
    monkeypatch.chdir(tmp_path)
    built = []
    hold = FrozenQuantLlama4Experts._hold
    monkeypatch.setattr(FrozenQuantLlama4Experts, "_hold", lambda self, *a: (built.append(self), hold(self, *a)))
    run_inprocess(compose, [*TINY, "model=llama4_tiny", f"precision={recipe}", "trainer.lora.rank=8",
                            "trainer.lora.target_modules=[q_proj,v_proj,experts]", "steps=2",
                            "rollout.check_weight_sync=true"], tmp_path / "run")
    assert len(built) == 2  # the trainer's two MoE layers (the engine holds its experts dense)
    metrics = journal_metrics(tmp_path / "run")
    print({step: metrics[step]["mismatch/logprob_abs_diff"] for step in (1, 2)})
    assert metrics[1]["train/ppo_kl"] == 0.0
    # fp8 (w8a16) measured exactly 0.0 since the bf16 residual stream (precision.fp32_residual=false):
    # the trainer rounds as the engine does, on the same dequantized weights.
    assert all(0.0 <= metrics[step]["mismatch/logprob_abs_diff"] < BOUND[recipe] for step in (1, 2)), metrics
    export = tmp_path / "run/checkpoint"
    config = json.loads((export / "adapter/adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == [f"model.layers.{i}.feed_forward.experts.{t}"
                                                   for i in (1, 3) for t in ("down_proj", "gate_up_proj")]
    adapter = load_file(export / "adapter/adapter_model.safetensors")
    assert any(t.abs().sum() > 0 for k, t in adapter.items() if k.endswith("feed_forward.experts.lora_B.weight"))
    dense = load_file(export / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in dense.values())  # the merged export is a dense checkpoint
