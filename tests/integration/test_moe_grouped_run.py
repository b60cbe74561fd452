"""A MoE run with the experts as grouped GEMMs (miles.models.moe.grouped_swiglu, CUDA's path) is the
expert loop's run: two GRPO steps of Qwen3-MoE's and Llama 4's tiny models in-process under the bf16
recipe, with the grouped GEMMs turned on for the CPU, log what the loop's run logs (the trainer's
forward and backward, recompute, the engine's prefill), and the first step's ppo_kl is 0."""

import pytest
import torch

from miles.models import moe
from runs import TINY, journal_metrics, run_inprocess, without_timing

pytestmark = [pytest.mark.slow, pytest.mark.no_ray]


@pytest.mark.parametrize("model", ["qwen3_moe_tiny", "llama4_tiny"])
def test_grouped_gemm_run_logs_the_loops_metrics(tmp_path, monkeypatch, compose, model):
    monkeypatch.chdir(tmp_path)
    overrides = [f"model={model}", "precision=bf16", "steps=2", "trainer.recompute=true", *TINY]
    grouped_mm, calls = torch._grouped_mm, []
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or grouped_mm(*a, **kw))
    runs = {}
    for name, devices in (("loop", ("cuda",)), ("grouped", ("cuda", "cpu"))):
        monkeypatch.setattr(moe, "GROUPED_GEMM_DEVICES", devices)
        run_inprocess(compose, overrides, tmp_path / name)
        runs[name] = without_timing(journal_metrics(tmp_path / name))
        assert bool(calls) == (name == "grouped")
    assert runs["grouped"][1]["train/ppo_kl"] == 0.0
    assert runs["grouped"] == runs["loop"]
