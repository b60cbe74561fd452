"""Two LoRA adapters in one run (trainer.lora.adapters; in-process, the shipped two-task prompt file
whose records name their adapter): every step logs each adapter's reward and sample count and the
trainer's per-adapter metrics; a run stopped after 2 steps and resumed to 3 logs what a straight
3-step run logs and ends with the same adapters, bit for bit; PPO trains a critic per adapter and
resumes them. A record that names no adapter of the run stops launch.py before anything starts
(exit 2), naming the file, the record and the adapters."""

import pytest

from launch_cli import ROOT, run_launch
from runs import TINY, file_digest, journal_metrics, run_inprocess, without_timing

pytestmark = pytest.mark.slow

DATA = ROOT / "examples/data/two_tasks"
TWO = ["task.name=two_tasks", "task.kind=file", f"task.train_file={DATA / 'train.jsonl'}",
       f"task.eval_file={DATA / 'test.jsonl'}", "trainer.lora.rank=8", "trainer.lr=1e-2",
       "trainer.lora.adapters=[add,mul]", "trainer.lora.adapter_key=adapter"]


def test_two_adapters_log_their_own_metrics_and_resume_exactly(tmp_path, monkeypatch, compose):
    monkeypatch.chdir(tmp_path)
    run_inprocess(compose, [*TINY, *TWO, "steps=3"], tmp_path / "straight")
    ckpt = tmp_path / "ckpt"
    run_inprocess(compose, [*TINY, *TWO, "steps=2", f"checkpoint.dir={ckpt}"], tmp_path / "first")
    assert (ckpt / "step_000002/adapter/mul/adapter_model.safetensors").is_file()
    run_inprocess(compose, [*TINY, *TWO, "steps=3", f"checkpoint.dir={ckpt}"], tmp_path / "second")

    straight = without_timing(journal_metrics(tmp_path / "straight"))
    for step in (1, 2, 3):
        m = straight[step]
        counts = [m.get(f"rollout/samples/{name}", 0.0) for name in ("add", "mul")]
        assert sum(counts) == 8  # rollout.batch_size 2 x 4 samples, each counted under its adapter
        for name, count in zip(("add", "mul"), counts):
            if count:
                assert f"rollout/reward_mean/{name}" in m and f"train/grad_norm/{name}" in m
                assert f"train/pg_loss/{name}" in m
        assert "eval/two_tasks/accuracy/add" in m and "eval/two_tasks/accuracy/mul" in m
    first, second = (without_timing(journal_metrics(tmp_path / d)) for d in ("first", "second"))
    stitched = {**first, **second}
    stitched[2] = {k: v for k, v in stitched[2].items() if k != "final/objective"}
    assert stitched == straight
    for name in ("model.safetensors", *(f"adapter/{a}/adapter_model.safetensors" for a in ("add", "mul"))):
        straight_file, resumed_file = (tmp_path / run / "checkpoint" / name for run in ("straight", "second"))
        assert file_digest(resumed_file) == file_digest(straight_file)


def test_ppo_trains_a_critic_per_adapter_and_resumes_them(tmp_path, monkeypatch, compose):
    monkeypatch.chdir(tmp_path)
    # The overlong penalty gives the random policy's long responses nonzero rewards: the critics learn.
    ppo = [*TINY, *TWO, "algo=ppo", "algo.overlong_buffer=4"]
    run_inprocess(compose, [*ppo, "steps=2"], tmp_path / "straight")
    ckpt = tmp_path / "ckpt"
    run_inprocess(compose, [*ppo, "steps=1", f"checkpoint.dir={ckpt}"], tmp_path / "first")
    assert sorted(p.name for p in (ckpt / "step_000001").glob("critic*")) == ["critic-add.pt", "critic-mul.pt"]
    run_inprocess(compose, [*ppo, "steps=2", f"checkpoint.dir={ckpt}"], tmp_path / "second")

    straight = without_timing(journal_metrics(tmp_path / "straight"))
    assert straight[1]["train/ppo_kl"] == 0.0  # the first update's ratios are against the same weights
    for step in (1, 2):
        m = straight[step]
        print(step, {k: v for k, v in m.items() if k.startswith(("critic/", "train/ppo_kl", "rollout/samples/"))})
        present = [name for name in ("add", "mul") if m.get(f"rollout/samples/{name}", 0.0)]
        for name in present:
            for key in ("value_loss", "grad_norm", "vf_clipfrac", "value_mean", "explained_var"):
                assert f"critic/{key}/{name}" in m, (step, name, key)
            assert f"train/ppo_kl/{name}" in m
        for name in {"add", "mul"} - set(present):  # an adapter without samples in the step: its critic untouched
            assert f"critic/value_loss/{name}" not in m
        assert m["critic/value_loss"] > 0 and m["critic/grad_norm"] > 0
    second = without_timing(journal_metrics(tmp_path / "second"))
    assert second[2] == straight[2]


def test_a_record_without_a_known_adapter_exits_2(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2", "adapter": "add"}\n'
                    '{"prompt": "2*3=", "label": "6", "adapter": "div"}\n'
                    '{"prompt": "2+2=", "label": "4"}\n')
    proc = run_launch(["task.kind=file", f"task.train_file={data}", "ray.enabled=false", "trainer.lora.rank=8",
                       "trainer.lora.adapters=[add,mul]", "trainer.lora.adapter_key=adapter"],
                      cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{data}, record 2: adapter='div' is not one of trainer.lora.adapters=['add', 'mul']" in proc.stderr
    assert f"{data}, record 3: no field 'adapter'" in proc.stderr
    assert "Traceback" not in proc.stderr
