"""Two LoRA adapters with speculative rollout, in-process (ray.enabled=false; this file starts no Ray):
a frozen draft model drafts for the policy, each row's adapter routes the verify forwards
(miles/rollout/spec_decode.py), and every step logs each adapter's reward and sample count, the
trainer's per-adapter metrics and the draft's acceptance; the engine's log-probs are the trainer's
(the small mismatch of a plain LoRA run: each row verified under its own adapter)."""

import pytest

from runs import TINY, journal_metrics, run_inprocess
from test_multi_lora_run import TWO

pytestmark = pytest.mark.slow

DRAFT = ["rollout.speculative.kind=draft_model", "rollout.speculative.draft_model=qwen3_tiny_draft",
         "rollout.speculative.train_online=false"]


def test_two_adapters_with_a_frozen_draft_log_per_adapter_metrics(tmp_path, monkeypatch, compose):
    monkeypatch.chdir(tmp_path)
    run_inprocess(compose, [*TINY, *TWO, *DRAFT, "steps=3"], tmp_path / "run")
    metrics = journal_metrics(tmp_path / "run")
    seen = set()
    for step in (1, 2, 3):
        m = metrics[step]
        print(step, {k: v for k, v in m.items() if k.startswith(("mismatch/", "spec/", "rollout/samples/"))})
        counts = [m.get(f"rollout/samples/{name}", 0.0) for name in ("add", "mul")]
        assert sum(counts) == 8
        for name, count in zip(("add", "mul"), counts):
            if count:
                seen.add((step, name))
                assert f"rollout/reward_mean/{name}" in m and f"train/pg_loss/{name}" in m
        assert 1.0 <= m["spec/accept_len"] <= 4.0
        assert m["mismatch/logprob_abs_diff"] < 1e-5  # fp32: rounding (measured ~8e-8)
    # Each adapter drafts-and-verifies in some step after the first update (non-zero B by then).
    assert {name for step, name in seen if step > 1} == {"add", "mul"}, seen
