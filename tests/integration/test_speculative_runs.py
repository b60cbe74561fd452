"""Speculative rollout end to end on the CPU, in-process: the draft trains online and reaches the
engine, a frozen draft does not move, and a resumed run continues with the draft's optimizer state.

The engine's samples are exact whatever the draft (tests/unit/rollout/test_spec_decode.py), so here
the checks are about the draft: its metrics, its weights on both sides, its state across a resume.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from runs import TINY, journal_metrics, run_inprocess, without_timing

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


def test_the_mtp_draft_trains_online_and_the_engine_drafts_with_it(tmp_path, monkeypatch, compose):
    monkeypatch.chdir(tmp_path)
    # debug.check_weight_sync compares every engine tensor with the trainer's after each sync: the MTP too.
    run_inprocess(compose, [*MTP, "steps=4", "rollout.max_new_tokens=12", "debug.check_weight_sync=true"],
                  tmp_path / "online")
    metrics = journal_metrics(tmp_path / "online")
    for step in range(1, 5):
        m = metrics[step]
        assert 1.0 <= m["spec/accept_len"] <= 4.0 and 0.0 <= m["spec/accept_rate"] <= 1.0
        assert m["spec/accept_len"] == pytest.approx(1 + 3 * m["spec/accept_rate"])
        assert m["spec/draft_loss"] > 0 and 0.0 <= m["spec/draft_accuracy"] <= 1.0
    run_inprocess(compose, [*MTP, "steps=4", "rollout.max_new_tokens=12", "rollout.speculative.train_online=false"],
                  tmp_path / "frozen")
    frozen = journal_metrics(tmp_path / "frozen")
    assert "spec/draft_loss" not in frozen[1] and "spec/accept_len" in frozen[1]
    online, still = mtp_tensors(tmp_path / "online"), mtp_tensors(tmp_path / "frozen")
    assert online and set(online) == set(still)
    init = load_file(str(tmp_path / "frozen" / "init" / "model.safetensors"))
    assert all(torch.equal(still[k], init[k]) for k in still)  # frozen: the random init, untouched
    assert not all(torch.equal(online[k], init[k]) for k in online)


def test_a_draft_model_run_resumes_with_its_draft_state(tmp_path, monkeypatch, compose):
    monkeypatch.chdir(tmp_path)
    run_inprocess(compose, [*DRAFT, "steps=4"], tmp_path / "straight")
    ckpt = tmp_path / "ckpt"
    run_inprocess(compose, [*DRAFT, "steps=2", f"checkpoint.dir={ckpt}"], tmp_path / "first")
    state = torch.load(ckpt / "step_000002" / "trainer.pt", weights_only=True)
    assert state["draft"]["kind"] == "draft_model" and state["draft"]["optimizer"]["state"]
    run_inprocess(compose, [*DRAFT, "steps=4", f"checkpoint.dir={ckpt}"], tmp_path / "second")
    straight = without_timing(journal_metrics(tmp_path / "straight"))
    second = without_timing(journal_metrics(tmp_path / "second"))
    assert second[3] == straight[3] and second[4] == straight[4]  # the draft's metrics and the samples too
    assert straight[4]["spec/draft_loss"] != straight[1]["spec/draft_loss"]
