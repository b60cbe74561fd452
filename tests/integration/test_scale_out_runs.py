"""The scale-out parts through launch.py, on real Ray and gloo: a 2-rank FSDP2 trainer with a fleet of 2
rollout engines, which checkpoints and resumes where it stopped; and the broadcast weight sync to a
fleet (the shared-memory one runs through launch.py in test_async_rollout.py). Both keep the
engines' weights equal to the trainer's (checked sync, ~1e-7 mismatch).
The components' own equalities (2 ranks = 1 rank, 2 engines = 1 engine, broadcast = object store)
are tested in tests/unit/trainer/test_fsdp.py, tests/unit/rollout/test_router.py and
tests/unit/transport/test_broadcast.py and test_shared_memory.py."""

import pytest
from launch_cli import run_launch
from runs import journal_metrics  # asserts too that no step was logged twice (the resumed run)

pytestmark = pytest.mark.slow
SMALL = ["warm_start.enabled=false", "eval.interval=100", "task.eval_size=8", "tracking.log_samples=0",
         "rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=16",
         "trainer.micro_batch_size=8", "checkpoint.interval=1"]
FSDP_FLEET = ["trainer=fsdp", "trainer.num_ranks=2", "rollout.num_engines=2"]


def check_steps(metrics: dict[int, dict], steps) -> None:
    assert set(steps) <= set(metrics)
    for step in steps:
        assert metrics[step]["perf/weight_sync_s"] > 0  # checked sync (rollout.check_weight_sync)
        assert metrics[step]["mismatch/logprob_abs_diff"] < 1e-5  # every engine holds the trainer's weights
        assert metrics[step]["train/ppo_kl"] == 0.0


def test_fsdp_ranks_with_an_engine_fleet_run_and_resume(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMALL, *FSDP_FLEET, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"hydra.run.dir={run_dir}"]
    first = run_launch([*args, "steps=1"], cwd=tmp_path)  # one step, then one more resumed from it
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_000001" / "trainer").is_dir()  # the ranks' sharded state
    resumed = run_launch([*args, "steps=2"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    check_steps(journal_metrics(run_dir), (1, 2))


def test_broadcast_weight_sync_to_an_engine_fleet(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_launch([*SMALL, "rollout.num_engines=2", "rollout.weight_sync=broadcast", "steps=2",
                       f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_steps(journal_metrics(run_dir), (1, 2))
