"""A GRPO run of the default task through miles.orchestrate.run with trainer=megatron, in-process on the
CPU (CUDA mapped to the CPU: cuda_on_cpu.py), against the same run with trainer=torch: engine, weight
sync, the RL update and the metrics journal end to end. tests/gpu/test_megatron_cuda.py runs 20 steps
of it on the H200 from the warm-start checkpoint."""

import pytest

from gpu_runs import run_inprocess  # noqa: E402  (tests/gpu helpers)

STEPS = 3


@pytest.mark.slow
def test_grpo_run_through_megatron_follows_the_torch_run(compose, tmp_path, monkeypatch, megatron_on_this_device):
    """(run() takes a validated config; validation's "CUDA only" rule is launch.py's, not in this path.)"""
    monkeypatch.chdir(tmp_path)
    # entropy_coef: a random policy solves nothing (all advantages 0), the entropy bonus still moves it
    common = ["precision=fp32", f"steps={STEPS}", "algo.entropy_coef=0.01", "warm_start.enabled=false", "eval.interval=100",
              "task.eval_size=8", "rollout.batch_size=8", "trainer.global_batch_size=64",
              "trainer.micro_batch_size=32", "trainer.pack_sequences=false", "hardware.cpu_threads=1",
              *([] if megatron_on_this_device == "cpu" else ["hardware=gpu"])]
    runs = {}
    for backend in ("megatron", "torch"):
        (tmp_path / backend).mkdir()
        runs[backend] = run_inprocess(compose, tmp_path / backend, [*common, f"trainer={backend}"])
    mega, native = runs["megatron"], runs["torch"]
    assert mega[1]["train/ppo_kl"] == 0.0 and mega[1]["train/pg_clipfrac"] == 0.0
    for key in ("rollout/reward_mean", "train/loss", "train/grad_norm"):
        assert [mega[s][key] for s in range(1, STEPS + 1)] == pytest.approx(
            [native[s][key] for s in range(1, STEPS + 1)], rel=1e-3, abs=1e-4), key
    assert all(mega[s]["mismatch/logprob_abs_diff"] < 1e-4 for s in range(1, STEPS + 1))  # fp32 engine vs Megatron
