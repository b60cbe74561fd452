"""Fault tolerance on real parts: SIGTERM mid-run, a rollout engine actor killed, a trainer that
fails, on local Ray actors started by the run; a failure that repeats identically stops after one
retry, in-process and from inside a Ray actor; the MLflow server case is in test_mlflow_outage.py."""

import json
import os
import signal

import pytest

from launch_cli import run_launch
from runs import TINY, LiveRun, actor_pid, file_digest, journal_metrics, run_inprocess, without_timing

pytestmark = pytest.mark.slow


def test_sigterm_saves_a_checkpoint_and_resuming_continues(tmp_path):
    ckpt = tmp_path / "ckpt"
    live = LiveRun([*TINY, "steps=40", f"checkpoint.dir={ckpt}"], cwd=tmp_path)
    live.wait_for("step    2/40")
    live.proc.send_signal(signal.SIGTERM)
    assert live.finish() == 128 + signal.SIGTERM, live.output[-3000:]
    out = live.output
    assert "Traceback" not in out
    (saved,) = ckpt.glob("step_*")  # interval 0: only the checkpoint the signal asked for
    step = json.loads((saved / "meta.json").read_text())["step"]
    assert 2 <= step < 40 and f"stopped by SIGTERM after step {step}; checkpoint in {saved}" in out

    from miles.models import from_pretrained

    assert from_pretrained(saved / "model").config.num_layers == 3  # an HF checkpoint that loads
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    journal = [json.loads(line) for line in (run_dir / "mlflow" / "journal.jsonl").read_text().splitlines()]
    assert journal[-1] == {**journal[-1], "op": "finish", "status": "KILLED"}

    # Resumed in-process: the checkpoint the Ray run's signal saved serves either arrangement (a Ray
    # resume: test_killed_trainer_actor_resumes_from_the_last_checkpoint).
    proc = run_launch([*TINY, f"steps={step + 2}", f"checkpoint.dir={ckpt}", "ray.enabled=false"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resuming from {saved} (step {step} of {step + 2})" in proc.stdout
    resumed_dir = max((tmp_path / "outputs").glob("*/*"), key=lambda p: p.stat().st_mtime)
    assert sorted(journal_metrics(resumed_dir)) == [step + 1, step + 2]


def test_killed_engine_actor_is_restarted_and_every_step_logged_once(tmp_path):
    # An engine actor of its own (ray.hybrid=false): one that shares the trainer's dies with it (below).
    live = LiveRun([*TINY, "steps=4", "ray.hybrid=false"], cwd=tmp_path)  # killed in step 3: restarted, steps 3 and 4 logged once
    live.wait_for("step    2/4")
    os.kill(actor_pid(live.proc.pid, "NativeEngine"), signal.SIGKILL)
    assert live.finish() == 0, live.output[-3000:]
    assert "the rollout engine actor died (ActorDiedError" in live.output and "restarting it, retry 1/3" in live.output
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    metrics = journal_metrics(run_dir)  # raises if a step was logged twice
    assert sorted(metrics) == list(range(5))
    for step in range(1, 5):
        assert {"rollout/reward_mean", "train/loss", "eval/arithmetic/accuracy"} <= set(metrics[step]), step

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("miles").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, 5))


def test_killed_trainer_actor_resumes_from_the_last_checkpoint(tmp_path):
    """The default run's engine and trainer share one actor (ray.hybrid): a dead one is a failed
    trainer, and the run resumes with both built again (a lone trainer actor takes the same path)."""
    live = LiveRun([*TINY, "steps=6", "checkpoint.interval=1"], cwd=tmp_path)
    live.wait_for("step    3/6")
    os.kill(actor_pid(live.proc.pid, "HybridWorker"), signal.SIGKILL)
    assert live.finish() == 0, live.output[-3000:]
    assert "the run failed" in live.output and "resuming from" in live.output
    assert "done: final held-out accuracy" in live.output


@pytest.mark.no_ray
def test_trainer_failure_resumes_with_no_trace_in_the_results(tmp_path, monkeypatch, compose, capsys):
    """In-process: the trainer raises once in step 3; with a checkpoint every step the run resumes
    from step 2 and ends with the weights and metrics of a run that never failed."""
    from miles.trainer.torch_trainer import TorchTrainer

    monkeypatch.chdir(tmp_path)
    run_inprocess(compose, [*TINY, "steps=4"], tmp_path / "straight")

    calls = {"n": 0}
    train_rl = TorchTrainer.train_rl

    def failing_once(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected trainer failure")
        return train_rl(self, batch)

    monkeypatch.setattr(TorchTrainer, "train_rl", failing_once)
    run_inprocess(compose, [*TINY, "steps=4", "checkpoint.interval=1"], tmp_path / "failed")
    out = capsys.readouterr().out
    assert "the run failed (RuntimeError: injected trainer failure); resuming from the last checkpoint, retry 1/3" in out
    assert "(step 2 of 4)" in out
    assert without_timing(journal_metrics(tmp_path / "failed")) == without_timing(journal_metrics(tmp_path / "straight"))
    assert file_digest(tmp_path / "failed/checkpoint/model.safetensors") == \
        file_digest(tmp_path / "straight/checkpoint/model.safetensors")


@pytest.mark.no_ray
def test_retries_are_bounded(tmp_path, monkeypatch, compose):
    """Failures that differ each time (not a repeat of the previous one) are retried up to the limit."""
    from miles.trainer.torch_trainer import TorchTrainer

    monkeypatch.chdir(tmp_path)
    calls = {"n": 0}

    def always_failing(self, batch):
        calls["n"] += 1
        raise RuntimeError(f"broken trainer, call {calls['n']}")

    monkeypatch.setattr(TorchTrainer, "train_rl", always_failing)
    with pytest.raises(RuntimeError, match="broken trainer, call 2"):
        run_inprocess(compose, [*TINY, "steps=2", "fault.max_retries=1"], tmp_path / "run")
    journal = (tmp_path / "run" / "mlflow" / "journal.jsonl").read_text().splitlines()
    assert json.loads(journal[-1])["status"] == "FAILED"


@pytest.mark.no_ray
def test_an_identical_failure_is_reported_after_the_first_retry(tmp_path, monkeypatch, compose, capsys):
    """The same error at the same step again: a deterministic fault, reported once with its cause
    and where it was raised, not retried to fault.max_retries."""
    from miles.orchestrate.supervise import RepeatedFault
    from miles.trainer.torch_trainer import TorchTrainer

    monkeypatch.chdir(tmp_path)
    calls = {"n": 0}

    def always_failing(self, batch):
        calls["n"] += 1
        raise RuntimeError("broken trainer")

    monkeypatch.setattr(TorchTrainer, "train_rl", always_failing)
    with pytest.raises(RepeatedFault) as stop:
        run_inprocess(compose, [*TINY, "steps=2"], tmp_path / "run")  # fault.max_retries=3
    out = capsys.readouterr().out
    assert calls["n"] == 2 and out.count("retry 1/3") == 1 and "retry 2/3" not in out
    assert isinstance(stop.value.__cause__, RuntimeError)
    assert str(stop.value).startswith("the run failed again in step 1 with the same error, so it was not retried: "
                                      "RuntimeError: broken trainer (tests/integration/test_fault.py:")
    assert ("the run failed again in step 1 with the same error: a fault a retry does not cure, so no more retries "
            "(1 of fault.max_retries=3 used)\n  error: RuntimeError: broken trainer\n  where: tests/integration/"
            "test_fault.py:") in out
    journal = (tmp_path / "run" / "mlflow" / "journal.jsonl").read_text().splitlines()
    assert json.loads(journal[-1])["status"] == "FAILED"


def _supervise_actors(compose, tmp_path, engine_cls, trainer_cls, loop):
    """supervise() over real Ray actors of these classes until it stops with RepeatedFault:
    (how many times the components were built, the lines it logged, the fault it reported)."""
    import types

    import ray

    from miles.orchestrate.handles import spawn, start_ray
    from miles.orchestrate.loop import LoopContext
    from miles.orchestrate.resume import CheckpointStore
    from miles.orchestrate.supervise import RepeatedFault, supervise

    builds, lines = [], []

    def build():
        builds.append(1)
        return LoopContext(engine=spawn(engine_cls, True), trainer=spawn(trainer_cls, True), tokenizer=None,
                           source=types.SimpleNamespace(state=dict, load_state=lambda state: None),
                           reward_fn=lambda *args: 0.0, log=lambda metrics, step: None)

    start_ray(None, None)
    try:
        with pytest.raises(RepeatedFault) as stop:
            supervise(compose(["steps=2"]), CheckpointStore(tmp_path / "ckpt", 1, enabled=False), build, loop,
                      tmp_path, {}, log=lines.append)
    finally:
        ray.shutdown()
    return len(builds), lines, stop.value.fault


def test_an_identical_failure_inside_a_ray_actor_is_reported_after_the_first_retry(tmp_path, compose):
    """Through real actors: the root cause is read out of Ray's task error (not RayTaskError's pid
    line), and the restarted actor's new pid does not make the repeat a new failure."""
    import torch

    class Trainer:  # defined here: Ray pickles it by value
        def get_weights(self):
            return {"w": torch.ones(4, dtype=torch.float8_e4m3fn)}, "digest"

    class Engine:
        def update_weights(self, weights, digest):
            assert weights["w"].dtype == torch.float8_e4m3fn
            return digest

        def generate(self):
            raise ValueError(f"this engine cannot generate (pid={os.getpid()})")

    builds, lines, fault = _supervise_actors(compose, tmp_path, Engine, Trainer, lambda ctx: ctx.engine.call("generate"))
    assert builds == 2 and len(lines) == 2
    assert lines[0].startswith("the run failed (ValueError: this engine cannot generate (pid=")
    assert lines[0].endswith("); starting over (no checkpoint yet), retry 1/3")
    assert (fault.type, fault.at) == ("ValueError", "in step 1")
    assert fault.where.startswith("tests/integration/test_fault.py:") and \
        fault.where.endswith(" in generate, in ray::Engine.generate()")


def test_an_actor_whose_constructor_raises_is_reported_after_the_first_retry(tmp_path, compose):
    """Ray reports a constructor's error as ActorDiedError, a RayActorError, which alone would count
    as a dead process a retry can cure: the same ValueError was rebuilt fault.max_retries times. An
    actor whose creation task raised is a deterministic fault: one retry, then RepeatedFault naming
    the constructor's error and where it was raised."""

    class Trainer:  # defined here: Ray pickles it by value
        def __init__(self):
            raise ValueError(f"rollout.x=1 does not combine with this trainer (pid={os.getpid()})")

        def get_weights(self):
            return {}, ""

    class Engine:
        def update_weights(self, weights, digest):
            return digest

    builds, lines, fault = _supervise_actors(compose, tmp_path, Engine, Trainer, lambda ctx: 0.0)
    assert builds == 2 and len(lines) == 2, lines
    assert (fault.type, fault.transient) == ("ValueError", False)
    assert fault.message.startswith("rollout.x=1 does not combine with this trainer")
    assert fault.where.startswith("tests/integration/test_fault.py:") and " in __init__" in fault.where
