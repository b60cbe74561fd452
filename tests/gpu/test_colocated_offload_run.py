"""rollout.offload / trainer.offload through the real loop on CUDA: a run whose engine releases its
weights and KV cache while the trainer trains, and whose trainer waits in host memory while the
engine generates, logs what the same run does with both sides resident (rewards, losses, mismatch,
eval) and a lower device peak in each phase (perf/peak_mem_rollout_gb, perf/peak_mem_train_gb,
perf/peak_mem_sync_gb).

Skipped without a GPU (CI). On a GPU machine: `pytest -s tests/gpu/test_colocated_offload_run.py`
(prints the peaks per phase)."""

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
STEPS = 3
RUN = ["hardware=gpu", "precision=bf16", f"steps={STEPS}", "warm_start.enabled=false", f"eval.interval={STEPS}",
       "task.eval_size=16", "rollout.batch_size=16", "trainer.global_batch_size=128", "trainer.micro_batch_size=64",
       "algo.entropy_coef=0.01", "deterministic=true", "model=qwen3_0_6b", "rollout.max_new_tokens=32"]
PEAKS = ("perf/peak_mem_rollout_gb", "perf/peak_mem_train_gb", "perf/peak_mem_sync_gb")


def test_offloaded_run_equals_the_resident_run_with_lower_peaks(compose, tmp_path, monkeypatch):
    pytest.importorskip("hydra")
    from gpu_runs import run_inprocess

    monkeypatch.chdir(tmp_path)
    (tmp_path / "resident").mkdir()
    (tmp_path / "offloaded").mkdir()
    before = torch.cuda.memory_allocated()
    resident = run_inprocess(compose, tmp_path / "resident", RUN)
    # The peaks are the process's: the first run's components must be gone before the second starts
    # (unreachable, but in reference cycles: a run measured +18.6 GB when the collector had not run).
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() - before < 2**30
    offloaded = run_inprocess(compose, tmp_path / "offloaded", [*RUN, "rollout.offload=true", "trainer.offload=true"])
    for step in range(1, STEPS + 1):
        for key in PEAKS:
            print(f"step {step} {key}: resident {resident[step][key]:.2f} GB, offloaded {offloaded[step][key]:.2f} GB")
        same = {k: v for k, v in resident[step].items() if not k.startswith("perf/") and k != "rollout/tokens_per_s"}
        assert {k: offloaded[step][k] for k in same} == same
    for key in PEAKS:  # steady steps: each phase holds one side only
        assert offloaded[STEPS][key] < resident[STEPS][key], (key, offloaded[STEPS][key], resident[STEPS][key])
