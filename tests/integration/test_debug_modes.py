"""Debug modes, in-process: rollout only, train only on saved rollouts, replay with an engine, and
the tensor-level weight sync check; replayed rollouts reproduce the training bit for bit."""

import json

import pytest

from miles.validate import validate
from runs import TINY, file_digest, journal_metrics, run_inprocess

pytestmark = pytest.mark.slow
TRAIN_KEYS = ("train/", "mismatch/")


def train_metrics(run_dir):
    return {s: {k: v for k, v in m.items() if k.startswith(TRAIN_KEYS)} for s, m in journal_metrics(run_dir).items()
            if s > 0}


def test_rollout_only_generates_and_scores_without_a_trainer(tmp_path, monkeypatch, compose):
    monkeypatch.chdir(tmp_path)
    rollouts = tmp_path / "rollouts"
    run_inprocess(compose, [*TINY, "steps=2", "debug.rollout_only=true", f"debug.save_rollouts={rollouts}"],
                  tmp_path / "run")
    metrics = journal_metrics(tmp_path / "run")
    assert sorted(metrics) == [0, 1, 2]
    assert "rollout/reward_mean" in metrics[1] and not any(k.startswith("train/") for k in metrics[1])
    assert not (tmp_path / "run" / "checkpoint").exists() and not (tmp_path / "run" / "checkpoints").exists()
    batch = json.loads((rollouts / "step_000001.json").read_text())
    assert len(batch["samples"]) == 8 and {"prompt_ids", "response_ids", "rollout_logprobs", "reward"} <= set(
        batch["samples"][0])


def test_replayed_rollouts_reproduce_training(tmp_path, monkeypatch, compose):
    monkeypatch.chdir(tmp_path)
    rollouts = tmp_path / "rollouts"
    run_inprocess(compose, [*TINY, "steps=2", f"debug.save_rollouts={rollouts}"], tmp_path / "recorded")
    # No engine at all: the trainer sees the recorded batches, nothing is generated or evaluated.
    run_inprocess(compose, [*TINY, "steps=2", "debug.train_only=true", f"debug.load_rollouts={rollouts}"],
                  tmp_path / "train_only")
    # With an engine: the batches are replayed, weights are synced and evaluated as usual.
    run_inprocess(compose, [*TINY, "steps=2", f"debug.load_rollouts={rollouts}", "debug.compare_weights_tensorwise=true"],
                  tmp_path / "replayed")
    recorded = train_metrics(tmp_path / "recorded")
    assert recorded == train_metrics(tmp_path / "train_only") == train_metrics(tmp_path / "replayed")
    weights = file_digest(tmp_path / "recorded/checkpoint/model.safetensors")
    assert weights == file_digest(tmp_path / "train_only/checkpoint/model.safetensors")
    assert weights == file_digest(tmp_path / "replayed/checkpoint/model.safetensors")
    assert not any(k.startswith("eval/") for m in journal_metrics(tmp_path / "train_only").values() for k in m)
    assert "eval/arithmetic/accuracy" in journal_metrics(tmp_path / "replayed")[2]


def test_replayed_rollouts_with_images_reproduce_training(tmp_path, monkeypatch, compose):
    """A vision-language run's saved batches hold each prompt's images (once per group); training on
    them alone gives the recorded run's metrics and weights bit for bit."""
    monkeypatch.chdir(tmp_path)
    rollouts = tmp_path / "rollouts"
    vlm = ["+experiment=shape_count_vlm", "steps=2", "warm_start.enabled=false", "eval.interval=100",
           "task.eval_size=8", "task.train_size=64", "rollout.batch_size=2", "rollout.n_samples_per_prompt=4",
           "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "ray.enabled=false", "tracking.log_samples=0"]
    run_inprocess(compose, [*vlm, f"debug.save_rollouts={rollouts}"], tmp_path / "recorded")
    batch = json.loads((rollouts / "step_000001.json").read_text())
    assert sorted(batch["images"]) == ["0", "1"] and all(s["images"] is None for s in batch["samples"])
    run_inprocess(compose, [*vlm, "debug.train_only=true", f"debug.load_rollouts={rollouts}"], tmp_path / "train_only")
    assert train_metrics(tmp_path / "recorded") == train_metrics(tmp_path / "train_only")
    assert file_digest(tmp_path / "recorded/checkpoint/model.safetensors") == \
        file_digest(tmp_path / "train_only/checkpoint/model.safetensors")


def test_debug_mode_mistakes_are_config_errors(tmp_path, compose):
    assert "debug.train_only needs debug.load_rollouts" in "\n".join(validate(compose(["debug.train_only=true"])))
    assert "exclude each other" in "\n".join(validate(compose(["debug.train_only=true", "debug.rollout_only=true"])))
    assert "holds no saved rollouts" in "\n".join(validate(compose([f"debug.load_rollouts={tmp_path}"])))
    (tmp_path / "rollouts.json").write_text(json.dumps({"rollout.batch_size": "3"}))
    problems = "\n".join(validate(compose([f"debug.load_rollouts={tmp_path}", "steps=2"])))
    assert "rollout.batch_size: 3 -> 64" in problems and "no batch for steps 1..2" in problems
