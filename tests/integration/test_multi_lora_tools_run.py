"""Two LoRA adapters with multi-turn tools in one run (trainer.lora.adapters + task.tools; in-process,
and with the engine and the trainer as Ray actors):
a tiny chat model SFT-trained to call the calculator (as tests/unit/rollout/test_multi_turn.py trains
it) is the run's checkpoint; its prompt file routes half the records to `add`, half to `mul`. The
trajectories call the tool, every turn is generated with its prompt's adapter, each adapter logs its
own metrics, and the engine's log-probs of step 2's samples (from the adapters step 1 trained) are the
trainer's (fp32). Unit-level: tests/unit/rollout/test_multi_turn_adapters.py."""

import json
import random

import pytest

from ray_runs import WITH_AND_WITHOUT_RAY, run_with
from runs import journal_metrics
from tool_caller import tool_caller as shared_tool_caller

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory):
    """A chat checkpoint that calls the calculator and copies its answer (120 SFT steps, fp32; trained
    once per session for every test that runs it: tests/tool_caller.py)."""
    return shared_tool_caller(tmp_path_factory)


@WITH_AND_WITHOUT_RAY
def test_two_adapters_with_tools_route_every_turn(tmp_path, monkeypatch, compose, tool_caller, ray):
    monkeypatch.chdir(tmp_path)
    rng = random.Random(1)
    for split, count in (("train", 32), ("test", 8)):
        records = [{"prompt": f"{a}*{b}", "label": str(a * b), "adapter": ("add", "mul")[i % 2]}
                   for i, (a, b) in enumerate((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(count))]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run_with(compose, [
        f"model.hf_checkpoint={tool_caller}", "warm_start.enabled=false", "precision=fp32", "steps=2",
        "task.name=tools", "task.kind=file", f"task.train_file={tmp_path / 'train.jsonl'}",
        f"task.eval_file={tmp_path / 'test.jsonl'}", "task.apply_chat_template=true", "task.tools=[calculator]",
        "rollout.max_turns=2", "rollout.max_new_tokens=120", "eval.max_new_tokens=120", "eval.interval=1",
        "task.eval_size=8", "tracking.log_samples=0", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
        "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "algo.entropy_coef=0.01",
        "trainer.lora.rank=8", "trainer.lr=1e-2", "trainer.lora.adapters=[add,mul]",
        "trainer.lora.adapter_key=adapter"], tmp_path / "run", ray)
    metrics = journal_metrics(tmp_path / "run")
    for step in (1, 2):
        m = metrics[step]
        print(step, {k: v for k, v in m.items() if k.startswith(("mismatch/", "rollout/tool", "rollout/turns"))})
        assert m["rollout/tool_call_rate"] >= 0.25 and m["rollout/turns_mean"] > 1.2  # trajectories with a tool turn
        assert m["mismatch/logprob_abs_diff"] < 1e-6, m
        assert sum(m[f"rollout/samples/{name}"] for name in ("add", "mul")) == 16
        for name in ("add", "mul"):
            assert f"rollout/reward_mean/{name}" in m and f"train/grad_norm/{name}" in m
            assert f"eval/tools/accuracy/{name}" in m
    assert metrics[2]["train/entropy"] != metrics[1]["train/entropy"]
