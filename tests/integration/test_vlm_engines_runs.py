"""Vision-language runs through an external rollout engine (docs/rollout.md, docs/vlm.md): `launch.py`'s
run (in-process) of the visual task with rollout=sglang, SGLang MOCKED by the local STAND-IN server
(tests/unit/rollout/sglang_standin.py, not SGLang: SGLang 0.5.23's documented /generate `image_data`
over the native engine's vision-language path; SGLang cannot run here). rollout=vllm with images runs in
the vLLM tier (tests/vllm/test_vllm_images.py) where torchvision imports; elsewhere, and for families or
sizes an engine does not take, launch.py exits 2 naming the key (below).

The tower is trained (trainer.freeze_vision=false), so each step's sync must carry new tower weights
for the server's log-probs to equal the trainer's: every sync is checked tensor by tensor through
/weights_checker in SGLang's Qwen2.5-VL layout, and mismatch/logprob_abs_diff stays at fp32 noise.
"""

import sys
from pathlib import Path

import pytest
from launch_cli import run_launch
from runs import journal_metrics, run_inprocess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "rollout"))
import sglang_standin as standin  # noqa: E402

pytestmark = pytest.mark.slow

TINY = ["+experiment=shape_count_vlm", "steps=2", "warm_start.enabled=false", "eval.interval=1",
        "task.eval_size=8", "task.train_size=64", "rollout.batch_size=2", "rollout.n_samples_per_prompt=4",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "tracking.log_samples=0"]


def test_visual_task_steps_through_the_sglang_adapter(tmp_path, monkeypatch, compose):
    from miles.data.source import PromptSource
    from miles.orchestrate.checkpoints import random_checkpoint
    from miles.orchestrate.prompting import uses_chat

    monkeypatch.chdir(tmp_path)
    cfg = compose(TINY)
    source = PromptSource(cfg.task, cfg.seed)
    # Another seed than the run's initial weights: only the first sync makes the server hold them.
    served = random_checkpoint(cfg.model, source.alphabet(), 123, tmp_path / "served", chat=uses_chat(cfg, source))
    server = standin.StandInServer(str(served)).start()
    try:
        run_inprocess(compose, [*TINY, "trainer.freeze_vision=false", "rollout=sglang",
                                f"rollout.sglang.url={server.url}"], tmp_path / "run")
    finally:
        server.kill()
    metrics = journal_metrics(tmp_path / "run")
    for step in (1, 2):
        assert metrics[step]["mismatch/logprob_abs_diff"] < 1e-5, metrics[step]
        assert "eval/shape_count/accuracy" in metrics[step]
    assert metrics[1]["train/ppo_kl"] == 0.0
    paths = [path for _, path, _ in server.log]
    assert paths.count("/update_weights_from_disk") == paths.count("/weights_checker") == 3  # first sync + 2 steps
    rows = [body for body in server.bodies("/generate") if body.get("image_data")]
    assert rows and all(len(b["image_data"]) == len(b["input_ids"]) for b in rows)


@pytest.mark.parametrize("overrides, expected", [
    (["rollout=sglang", "model=qwen3_vl_tiny"], "rollout=sglang takes images for qwen2_5_vl only"),
    (["rollout=vllm"], "rollout=vllm on the CPU takes model.head_dim in [32, 64"),
    (["rollout=vllm", "model=glm4v_moe_tiny"], "rollout=vllm takes images for qwen2_5_vl only"),
])
def test_engines_refuse_what_they_do_not_take(tmp_path, overrides, expected):
    proc = run_launch(["+experiment=shape_count_vlm", *overrides, "dry_run=true"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert expected in proc.stderr and "Traceback" not in proc.stderr
