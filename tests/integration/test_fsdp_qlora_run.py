"""QLoRA on the FSDP2 trainer through miles.orchestrate.run: 2 gloo ranks (Ray actors) hold the frozen
base quantized and sharded (miles/trainer/fsdp_qlora.py) and train the adapters; the native engine
holds the same base quantized and applies the synced adapters. Two steps, the checked sync on, in
fp32 compute so that trainer and engine agree to float rounding (in bf16 the mismatch is the
recipe's own: tests/integration/test_qlora_runs.py). Unit-level checks against the 1-process trainer:
tests/unit/trainer/test_fsdp_qlora.py."""

import pytest
from safetensors.torch import load_file

from ray_runs import run_with
from runs import TINY, journal_metrics

pytestmark = pytest.mark.slow

FP32_COMPUTE = ["precision.train_dtype=fp32", "precision.rollout_dtype=fp32"]
# Measured (2026-12-04, 2 cores): int4_qat 9.7e-8 / 9.0e-8, fp8 w8a16 1.5e-7 / 1.0e-7. FP8 w8a8 also
# quantizes activations (1x128 tiles), where the engine's and the trainer's fp32 rounding differences
# flip a code now and then: 5.9e-4 at step 1, before any adapter moved, with trainer=torch too (the
# same value), and 1.9e-4 at step 2.
BOUND = {"int4_qat": 1e-6, "fp8_w8a16": 1e-6, "fp8": 2e-3}


# int4_qat in make test; the FP8 bases (their sharded holders: tests/unit/trainer/test_fsdp_qlora.py on
# 2 ranks) through a run in the extended tier (make test-extended).
@pytest.mark.parametrize("recipe", [r if r == "int4_qat" else pytest.param(r, marks=pytest.mark.extended)
                                    for r in sorted(BOUND)])
def test_fsdp_qlora_run(tmp_path, monkeypatch, compose, recipe):
    monkeypatch.chdir(tmp_path)
    precision = ["precision=fp8", "precision.fp8_scheme=w8a16"] if recipe == "fp8_w8a16" else [f"precision={recipe}"]
    run_with(compose, [*TINY, "trainer=fsdp", "trainer.num_ranks=2", *precision, *FP32_COMPUTE,
                       "trainer.lora.rank=8", "trainer.lr=3e-3", "steps=2", "rollout.check_weight_sync=true"],
             tmp_path / "run", ray=True)
    metrics = journal_metrics(tmp_path / "run")
    assert metrics[1]["train/ppo_kl"] == 0.0
    # Step 2's samples come from the adapters step 1 trained, scored by the engine with them.
    assert all(0.0 < metrics[step]["mismatch/logprob_abs_diff"] < BOUND[recipe] for step in (1, 2)), metrics
    adapter = load_file(tmp_path / "run/checkpoint/adapter/adapter_model.safetensors")
    assert any(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)  # the adapter moved
    assert (tmp_path / "run/checkpoint/model.safetensors").is_file()  # gathered on rank 0, merged there
