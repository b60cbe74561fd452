"""rollout.asynchronous: batches generated while the trainer trains, with bounded staleness.

- max_staleness=0 keeps the synchronous schedule through the rollout thread: the same metrics and
  weights bit for bit as the synchronous run (so the thread changes nothing but the timing);
- max_staleness=1: batch k+1 is generated while step k trains, `rollout/staleness` is 0 on the
  first step and 1 after; a checkpoint records the data position before the batch in flight, so a
  resumed run trains the same prompts as the run that was not interrupted;
- on real Ray, with the object store (weight snapshots) and with a collective transport, shared
  memory (synced with the engine idle); checked syncs;
- (`learning` tier) the default experiment learns as much in 60 steps as the synchronous run.

In-process runs of the tiny random model (miles.orchestrate.run, as launch.py calls it), except
the Ray tests (launch.py in a subprocess).
"""

import json

import pytest
from launch_cli import run_launch
from runs import TINY, file_digest, journal_metrics, run_inprocess, without_timing

pytestmark = pytest.mark.slow
STEPS = ["steps=4", "checkpoint.interval=2"]


def _run(compose, tmp_path, name, *overrides):
    run_dir = tmp_path / name
    run_inprocess(compose, [*TINY, *STEPS, f"debug.save_rollouts={tmp_path / name}_rollouts", *overrides], run_dir)
    return run_dir


def _prompts(tmp_path, name, step):
    batch = json.loads((tmp_path / f"{name}_rollouts" / f"step_{step:06d}.json").read_text())
    return [s["prompt_ids"] for s in batch["samples"]]


def _source_at(run_dir, step):
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "meta.json").read_text())["source"]


@pytest.mark.no_ray
def test_asynchronous_schedules_against_the_synchronous_run(tmp_path, monkeypatch, compose):
    monkeypatch.chdir(tmp_path)
    sync = _run(compose, tmp_path, "sync")
    zero = _run(compose, tmp_path, "zero", "rollout.asynchronous=true", "rollout.max_staleness=0")
    one = _run(compose, tmp_path, "one", "rollout.asynchronous=true", "rollout.max_staleness=1")

    # Staleness 0: the synchronous run exactly, through the rollout thread.
    assert without_timing(journal_metrics(zero)) == without_timing(journal_metrics(sync))
    assert file_digest(zero / "checkpoint/model.safetensors") == file_digest(sync / "checkpoint/model.safetensors")

    metrics = journal_metrics(one)
    assert [metrics[s]["rollout/staleness"] for s in range(1, 5)] == [0.0, 1.0, 1.0, 1.0]
    # PPO's ratio is against the behaviour policy (algo.use_rollout_logprobs: null -> true), a step behind
    assert all(metrics[s]["train/ppo_kl"] > 1e-4 for s in range(2, 5)) and metrics[1]["train/ppo_kl"] < 1e-6
    # The same prompts in the same order, one policy step behind from step 2 on: other samples.
    for step in range(1, 5):
        assert _prompts(tmp_path, "one", step) == _prompts(tmp_path, "sync", step)
    assert metrics[2]["mismatch/logprob_abs_diff"] > journal_metrics(sync)[2]["mismatch/logprob_abs_diff"]
    # The checkpoint after step 2 (batch 3 already drawn) records the position before batch 3.
    assert _source_at(one, 2) == _source_at(sync, 2)


@pytest.mark.no_ray
def test_a_resumed_asynchronous_run_trains_the_prompts_that_were_in_flight(tmp_path, monkeypatch, compose):
    import shutil

    monkeypatch.chdir(tmp_path)
    whole = _run(compose, tmp_path, "whole", "rollout.asynchronous=true")
    # Resume from the checkpoint saved after step 2, while batch 3 was being generated.
    shutil.copytree(whole / "checkpoints" / "step_000002", tmp_path / "saved" / "step_000002")
    resumed = _run(compose, tmp_path, "resumed", "rollout.asynchronous=true", f"checkpoint.dir={tmp_path / 'saved'}")
    metrics = journal_metrics(resumed)
    assert sorted(metrics) == [3, 4]
    assert metrics[3]["rollout/staleness"] == 0.0  # generated again, from the restored weights
    for step in (3, 4):
        assert _prompts(tmp_path, "resumed", step) == _prompts(tmp_path, "whole", step)
    assert journal_metrics(whole)[4]["rollout/staleness"] == 1.0


# shared_memory in the extended tier: the async loop's Ray path runs with the default transport, and
# the shared-memory transport's Ray sync has its own contract tests (tests/unit/transport).
@pytest.mark.parametrize("transport", ["object_store", pytest.param("shared_memory", marks=pytest.mark.extended)])
def test_asynchronous_on_ray(tmp_path, transport):
    run_dir = tmp_path / "run"
    proc = run_launch([*TINY, "steps=3", "eval.interval=3", "rollout.asynchronous=true",
                       f"rollout.weight_sync={transport}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                       f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = journal_metrics(run_dir)
    assert [metrics[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert all(metrics[s]["perf/weight_sync_s"] > 0 for s in (1, 2, 3))  # checked syncs (check_weight_sync)
    assert "eval/arithmetic/accuracy" in metrics[3]


@pytest.mark.learning
def test_asynchronous_learns_as_the_synchronous_run_does(tmp_path, monkeypatch, compose):
    """The default experiment (warm start included), 60 steps each way: the held-out gain of the
    asynchronous run is within 0.05 of the synchronous run's (the issue's bar)."""
    from launch_cli import ROOT

    monkeypatch.chdir(tmp_path)
    args = ["steps=60", "eval.interval=60", "tracking.log_samples=0", f"warm_start.cache_dir={ROOT / '.cache/miles'}"]
    gains = {}
    for mode in ("false", "true"):
        run_inprocess(compose, [*args, f"rollout.asynchronous={mode}"], tmp_path / mode)
        accuracy = {s: m["eval/arithmetic/accuracy"] for s, m in journal_metrics(tmp_path / mode).items()
                    if "eval/arithmetic/accuracy" in m}
        gains[mode] = accuracy[60] - accuracy[0]
    assert gains["false"] > 0.05, gains  # the synchronous run learns at all
    assert gains["true"] >= gains["false"] - 0.05, gains
