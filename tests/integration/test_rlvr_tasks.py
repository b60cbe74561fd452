"""The shipped RLVR example tasks learn, as a user runs them through launch.py:

- GSM8K format from a random tiny Qwen3 saved by transformers with a byte-level BPE tokenizer and a
  ChatML template (built here): the project's SFT warm start on the worked solutions, then GRPO with
  the math-verify reward raises held-out accuracy;
- multi-turn calculator use: after a warm start that calls the tool in a quarter of its examples,
  GRPO raises the tool-call rate and the accuracy.

Learning runs of the experiments as shipped, so the `learning` tier (`make test-learning`, minutes
each on 2 cores; not part of `make test`).
"""

import sys

import pytest

from launch_cli import ROOT, run_launch
from runs import journal_metrics

sys.path.insert(0, str(ROOT / "benchmarks"))
from chat_checkpoint import jsonl_texts, write_chat_checkpoint  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.learning]


def _accuracy(metrics, task):
    return {step: m[f"eval/{task}/accuracy"] for step, m in metrics.items() if f"eval/{task}/accuracy" in m}


def test_gsm8k_format_from_a_transformers_bpe_chat_model(tmp_path):
    data = ROOT / "examples" / "data" / "gsm8k_cpu"
    write_chat_checkpoint(tmp_path / "model", jsonl_texts(data / "test.jsonl") * 5)  # the qwen3_tiny sizes
    proc = run_launch(["+experiment=gsm8k_cpu", "ray.enabled=false", f"model.hf_checkpoint={tmp_path / 'model'}",
                       "warm_start.from_checkpoint=true", f"warm_start.cache_dir={tmp_path / 'cache'}",
                       f"task.train_file={data / 'train.parquet'}", f"task.eval_file={data / 'test.jsonl'}",
                       "warm_start.check_interval=100", "eval.interval=20"], cwd=tmp_path, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    accuracy = _accuracy(journal_metrics(run_dir), "gsm8k_cpu")
    assert accuracy[40] >= accuracy[0] + 0.05, accuracy  # RL on top of the warm start
    assert accuracy[0] >= 0.2, accuracy  # the warm start itself learned the format and some sums


def test_tool_use_is_learned(tmp_path):
    data = ROOT / "examples" / "data" / "tool_calc"
    proc = run_launch(["+experiment=tool_calc_cpu", "ray.enabled=false", f"warm_start.cache_dir={tmp_path / 'cache'}",
                       f"task.train_file={data / 'train.parquet'}", f"task.eval_file={data / 'test.jsonl'}",
                       "steps=6", "eval.interval=6"], cwd=tmp_path, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    metrics = journal_metrics(run_dir)
    accuracy = _accuracy(metrics, "tool_calc")
    calls = [metrics[step]["rollout/tool_call_rate"] for step in range(1, 7)]
    assert sum(calls[-2:]) / 2 >= sum(calls[:2]) / 2 + 0.2, calls  # sampled trajectories call the tool more
    assert accuracy[6] >= accuracy[0] + 0.2, accuracy
