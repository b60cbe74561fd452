"""Checkpoint / resume: a run stopped and resumed leaves no trace in its results; a checkpoint of
another config is refused before anything is touched; unwritable dirs stop the run at once."""

import json
import os
from pathlib import Path

import pytest

from launch_cli import run_launch
from runs import TINY, file_digest, journal_metrics, run_inprocess, without_timing

pytestmark = pytest.mark.slow


def test_four_steps_equal_two_then_two_more(tmp_path, monkeypatch, compose, capsys):
    monkeypatch.chdir(tmp_path)
    run_inprocess(compose, [*TINY, "steps=4"], tmp_path / "straight")
    ckpt = tmp_path / "ckpt"
    run_inprocess(compose, [*TINY, "steps=2", f"checkpoint.dir={ckpt}"], tmp_path / "first")
    assert [p.name for p in ckpt.iterdir()] == ["step_000002"]
    run_inprocess(compose, [*TINY, "steps=4", f"checkpoint.dir={ckpt}"], tmp_path / "second")
    assert f"resuming from {ckpt / 'step_000002'} (step 2 of 4)" in capsys.readouterr().out

    straight = without_timing(journal_metrics(tmp_path / "straight"))
    first, second = (without_timing(journal_metrics(tmp_path / d)) for d in ("first", "second"))
    assert sorted(second) == [3, 4]  # the resumed run neither re-evaluates step 0 nor repeats steps
    stitched = {**first, **second}
    stitched[2] = {k: v for k, v in stitched[2].items() if k != "final/objective"}  # the 2-step run's end
    assert stitched == straight
    assert straight[4]["train/entropy"] != straight[1]["train/entropy"]  # the weights did move
    # Bit-identical weights at the end, in the final HF checkpoint and in the resume checkpoint.
    assert file_digest(tmp_path / "second/checkpoint/model.safetensors") == \
        file_digest(tmp_path / "straight/checkpoint/model.safetensors")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002", "step_000004"]


def test_interval_keep_last_and_atomic_writes(tmp_path, monkeypatch, compose):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt"
    # A leftover of a save that died half-way (another pid): never picked up.
    (ckpt / ".tmp-step_000009-999999").mkdir(parents=True)
    run_inprocess(compose, [*TINY, "steps=5", "checkpoint.interval=2", "checkpoint.keep_last=2",
                            f"checkpoint.dir={ckpt}"], tmp_path / "run")
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000004", "step_000005"]
    meta = json.loads((ckpt / "step_000005" / "meta.json").read_text())
    assert meta["step"] == 5 and meta["config"]["algo.name"] == "grpo" and "rng" in meta["source"]


def test_refuses_another_config_and_touches_nothing(tmp_path, compose, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt"
    run_inprocess(compose, [*TINY, "steps=1", f"checkpoint.dir={ckpt}"], tmp_path / "first")
    before = {p: (p.stat().st_mtime_ns, file_digest(p)) for p in ckpt.rglob("*") if p.is_file()}

    proc = run_launch(["ray.enabled=false", *TINY, "steps=2", f"checkpoint.dir={ckpt}", "algo.eps_clip=0.3",
                       "model.hidden_size=64"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "algo.eps_clip: 0.2 -> 0.3" in proc.stderr and "model.hidden_size: 128 -> 64" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert {p: (p.stat().st_mtime_ns, file_digest(p)) for p in ckpt.rglob("*") if p.is_file()} == before


def test_unwritable_dirs_are_reported_before_training(tmp_path):
    blocker = tmp_path / "a_file"  # a path under a regular file cannot be created, even by root
    blocker.write_text("")
    proc = run_launch(["ray.enabled=false", *TINY, "steps=1", f"checkpoint.dir={blocker}/ckpt"], cwd=tmp_path)
    assert proc.returncode == 2
    assert f"checkpoint.dir={blocker}/ckpt is not writable" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "mlruns").exists()  # nothing started: no tracking run either

    proc = run_launch(["ray.enabled=false", *TINY, "steps=1", f"hydra.run.dir={blocker}/run"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "cannot write the run's output directory" in proc.stderr and "Traceback" not in proc.stderr
    if os.geteuid() != 0:  # permission bits bind everyone but root
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        proc = run_launch(["ray.enabled=false", *TINY, "steps=1", f"checkpoint.dir={locked}/ckpt"], cwd=tmp_path)
        assert proc.returncode == 2 and "checkpoint.dir" in proc.stderr
    assert Path(blocker).read_text() == ""


def test_ppo_critic_state_resumes_exactly(tmp_path, monkeypatch, compose):
    """PPO's critic is a third component with weights and an optimizer: it is checkpointed too."""
    monkeypatch.chdir(tmp_path)
    # The overlong penalty gives the random policy's long responses nonzero rewards: the critic learns.
    ppo = [*TINY, "algo=ppo", "algo.overlong_buffer=4"]
    run_inprocess(compose, [*ppo, "steps=2"], tmp_path / "straight")
    ckpt = tmp_path / "ckpt"
    run_inprocess(compose, [*ppo, "steps=1", f"checkpoint.dir={ckpt}"], tmp_path / "first")
    assert (ckpt / "step_000001" / "critic.pt").is_file()
    run_inprocess(compose, [*ppo, "steps=2", f"checkpoint.dir={ckpt}"], tmp_path / "second")
    straight = without_timing(journal_metrics(tmp_path / "straight"))
    assert without_timing(journal_metrics(tmp_path / "second"))[2] == straight[2]
    assert straight[1]["critic/value_loss"] > 0 and straight[1]["critic/grad_norm"] > 0
