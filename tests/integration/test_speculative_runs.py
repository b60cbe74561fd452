"""Speculative rollout end to end on the CPU, in-process and with Ray on (the default: the engine and
the trainer in actors of their own): the draft trains online and reaches the engine, a frozen draft
does not move, and a resumed run continues with the draft's optimizer state.

The engine's samples are exact whatever the draft (tests/unit/rollout/test_spec_decode.py), so here
the checks are about the draft: its metrics, its weights on both sides, its state across a resume.
The Ray variants exist because the in-process runs alone let a trainer check that only failed inside a
Ray actor through (issue 25, item 4); test_the_documented_command_with_ray_on_logs_the_acceptance runs
that issue's command as a user would (MTP trained online, with Ray on), so the MTP test's own Ray case
and the resumed draft model's are in the extended tier (make test-extended).
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from launch_cli import run_launch
from ray_runs import WITH_AND_WITHOUT_RAY_EXTENDED, run_with
from runs import TINY, journal_metrics, without_timing

pytestmark = pytest.mark.slow
MTP = [*TINY, "model=glm4_moe_tiny", "model.mtp_layers=1", "rollout.speculative.kind=mtp"]
DRAFT = [*TINY, "rollout.speculative.kind=draft_model", "rollout.speculative.draft_model=qwen3_tiny_draft"]


def mtp_tensors(run_dir):
    """The MTP layer's own tensors of a run's final checkpoint (published names: model.layers.<L>.*, but
    not its copies of the shared embedding and head, which the policy's updates move)."""
    weights = load_file(str(run_dir / "checkpoint" / "model.safetensors"))
    layers = json.loads((run_dir / "checkpoint" / "config.json").read_text())["num_hidden_layers"]
    shared = ("embed_tokens.weight", "shared_head.head.weight")
    return {k: v for k, v in weights.items() if k.startswith(f"model.layers.{layers}.") and not k.endswith(shared)}


@WITH_AND_WITHOUT_RAY_EXTENDED  # with Ray on in make test: test_the_documented_command_with_ray_on_...
def test_the_mtp_draft_trains_online_and_the_engine_drafts_with_it(tmp_path, monkeypatch, compose, ray):
    monkeypatch.chdir(tmp_path)
    # debug.compare_weights_tensorwise compares every engine tensor with the trainer's after each sync: the MTP too.
    run_with(compose, [*MTP, "steps=4", "rollout.max_new_tokens=12", "debug.compare_weights_tensorwise=true"],
             tmp_path / "online", ray)
    metrics = journal_metrics(tmp_path / "online")
    for step in range(1, 5):
        m = metrics[step]
        assert 1.0 <= m["spec/accept_len"] <= 4.0 and 0.0 <= m["spec/accept_rate"] <= 1.0
        assert m["spec/accept_len"] == pytest.approx(1 + 3 * m["spec/accept_rate"])
        assert m["spec/draft_loss"] > 0 and 0.0 <= m["spec/draft_accuracy"] <= 1.0
    run_with(compose, [*MTP, "steps=4", "rollout.max_new_tokens=12", "rollout.speculative.train_online=false"],
             tmp_path / "frozen", ray)
    frozen = journal_metrics(tmp_path / "frozen")
    assert "spec/draft_loss" not in frozen[1] and "spec/accept_len" in frozen[1]
    online, still = mtp_tensors(tmp_path / "online"), mtp_tensors(tmp_path / "frozen")
    assert online and set(online) == set(still)
    init = load_file(str(tmp_path / "frozen" / "init" / "model.safetensors"))
    assert all(torch.equal(still[k], init[k]) for k in still)  # frozen: the random init, untouched
    assert not all(torch.equal(online[k], init[k]) for k in online)


@WITH_AND_WITHOUT_RAY_EXTENDED  # with Ray: the documented command's test runs the draft in actors
def test_a_draft_model_run_resumes_with_its_draft_state(tmp_path, monkeypatch, compose, ray, request):
    monkeypatch.chdir(tmp_path)
    if ray:  # the three runs on one local Ray (ray_runs.run_with)
        request.getfixturevalue("ray_connection")
    run_with(compose, [*DRAFT, "steps=4"], tmp_path / "straight", ray)
    ckpt = tmp_path / "ckpt"
    run_with(compose, [*DRAFT, "steps=2", f"checkpoint.dir={ckpt}"], tmp_path / "first", ray)
    state = torch.load(ckpt / "step_000002" / "trainer.pt", weights_only=True)
    assert state["draft"]["kind"] == "draft_model" and state["draft"]["optimizer"]["state"]
    run_with(compose, [*DRAFT, "steps=4", f"checkpoint.dir={ckpt}"], tmp_path / "second", ray)
    straight = without_timing(journal_metrics(tmp_path / "straight"))
    second = without_timing(journal_metrics(tmp_path / "second"))
    for step in (3, 4):  # the draft's metrics and the samples too
        if not ray:
            assert second[step] == straight[step]
            continue
        # Through Ray, one full-suite run on 2 loaded cores (2026-12-03) saw the engine's log-probs of
        # the same samples differ by ~1e-6 after the resume (mismatch/* and, through them, grad_norm;
        # every other metric equal); other runs were bitwise. Not explained yet: those keys get a
        # tolerance here, the rest stays exact.
        loose = {k for k in straight[step] if k.startswith("mismatch/") or k == "train/grad_norm"}
        assert {k: v for k, v in second[step].items() if k not in loose} == \
            {k: v for k, v in straight[step].items() if k not in loose}
        for k in loose:
            assert second[step][k] == pytest.approx(straight[step][k], rel=1e-4, abs=1e-5), k
    assert straight[4]["spec/draft_loss"] != straight[1]["spec/draft_loss"]


# The command of issue 25 (item 4), as a user types it: Ray on, the default.
DOCUMENTED = ["model=deepseek_v3_tiny", "model.mtp_layers=1", "rollout.speculative.kind=mtp",
              "rollout.speculative.train_online=true", "steps=2", "warm_start.enabled=false"]


def test_the_documented_command_with_ray_on_logs_the_acceptance(tmp_path):
    from mlflow.tracking import MlflowClient
    from omegaconf import OmegaConf

    proc = run_launch(DOCUMENTED, cwd=tmp_path, env_extra={"MILES_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    resolved = OmegaConf.load(run_dir / "resolved.yaml")
    assert resolved.ray.enabled and resolved.rollout.speculative.train_online  # the default arrangement
    metrics = journal_metrics(run_dir)
    for step in (1, 2):  # the engine drafted, and the trainer trained the draft, in their Ray actors
        assert 1.0 <= metrics[step]["spec/accept_len"] <= 4.0
        assert metrics[step]["spec/draft_loss"] > 0
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    (record,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert record.info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(record.info.run_id, "spec/accept_len")} == {1, 2}
