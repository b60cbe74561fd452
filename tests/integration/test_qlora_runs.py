"""LoRA runs under the quantized precision recipes through miles.orchestrate.run, in-process (and the
fp8 one and the merged engine adapter with Ray actors): QLoRA
(fp8, int4_qat: the trainer's frozen base quantized as the engine's) and LoRA with a quantized
rollout only (bf16_train_*_rollout: a bf16 base in the trainer). Two steps each, the checked sync
on; the engine's log-probs of its samples stay within the recipe's mismatch, and the run ends with
its merged export and the adapter. Unit-level checks against references: tests/unit/trainer/test_qlora.py."""

import pytest
import torch
from safetensors.torch import load_file

from launch_cli import run_launch
from runs import TINY, journal_metrics, run_inprocess

pytestmark = pytest.mark.slow

# The recipes' mismatch without LoRA (docs/precision.md, 20 steps on a trained qwen3_tiny: fp8
# 2.2e-2, int4_qat 9.4e-3, bf16_train_fp8_rollout 2.8e-2, bf16_train_int4_rollout 5.5e-2) sets the
# scale; measured here (random init, 2 steps, 2026-12-04): 1.0e-2 / 7.5e-3, 1.7e-3 / 1.5e-3,
# 1.3e-2 / 1.1e-2, 5.3e-2 / 3.4e-2.
BOUND = {"fp8": 2e-2, "int4_qat": 5e-3, "bf16_train_fp8_rollout": 3e-2, "bf16_train_int4_rollout": 1e-1}


@pytest.mark.no_ray
@pytest.mark.parametrize("recipe", sorted(BOUND))
def test_lora_run_under_a_quantized_recipe(tmp_path, monkeypatch, compose, recipe):
    monkeypatch.chdir(tmp_path)
    run_inprocess(compose, [*TINY, f"precision={recipe}", "trainer.lora.rank=8", "trainer.lr=3e-3", "steps=2",
                            "rollout.check_weight_sync=true"], tmp_path / "run")
    metrics = journal_metrics(tmp_path / "run")
    assert metrics[1]["train/ppo_kl"] == 0.0
    for step in (1, 2):
        assert 0.0 < metrics[step]["mismatch/logprob_abs_diff"] < BOUND[recipe], metrics[step]
    export = tmp_path / "run/checkpoint"
    adapter = load_file(export / "adapter/adapter_model.safetensors")
    assert any(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)  # the adapter moved
    dense = load_file(export / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in dense.values())  # the merged export is a dense checkpoint


@pytest.mark.no_ray
def test_merging_into_a_quantized_engine_exits_2(tmp_path):
    proc = run_launch(["precision=fp8", "trainer.lora.rank=8", "trainer.lora.merge_in_engine=true",
                       "ray.enabled=false"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and "set trainer.lora.merge_in_engine=false" in proc.stderr


@pytest.mark.parametrize("overrides", [["precision=fp8"], ["trainer.lora.merge_in_engine=true"]],
                         ids=["qlora-fp8", "merged-engine"])
def test_with_ray_actors(tmp_path, monkeypatch, compose, overrides, ray_connection):
    """The same through Ray actors (the default arrangement): the FP8-held base and the engine's merged
    adapter pickle into their actors, and the adapters-only sync reaches them (checked). Both runs on
    the module's one local Ray (ray_runs.run_with)."""
    from ray_runs import run_with

    monkeypatch.chdir(tmp_path)
    run_with(compose, [*TINY, *overrides, "trainer.lora.rank=8", "trainer.lr=3e-3", "steps=2",
                       "rollout.check_weight_sync=true"], tmp_path / "run", ray=True)
    metrics = journal_metrics(tmp_path / "run")
    bound = BOUND["fp8"] if "precision=fp8" in overrides else 1e-5
    assert metrics[1]["train/ppo_kl"] == 0.0
    assert all(0.0 < metrics[step]["mismatch/logprob_abs_diff"] < bound for step in (1, 2)), metrics
