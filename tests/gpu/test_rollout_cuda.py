"""The GPU rollout path (slot decode, CUDA graphs) and a GRPO smoke run on CUDA.

Skipped without a GPU (CI). On a GPU machine: `pytest tests/gpu` (the GRPO run also needs Hydra and
OmegaConf; MLflow is optional: without it the run logs to its local journal only).
"""

import json
from pathlib import Path

import pytest
import torch

from miles.config.schema import DType, ModelCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from gpu_runs import max_lp_diff, responses, slot_engines

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SMALL = ModelCfg(name="qwen3_small", hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                 num_kv_heads=4, head_dim=32, max_position_embeddings=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(random_checkpoint(SMALL, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("ckpt") / "m"))


@pytest.mark.parametrize("dtype", [DType.fp32, DType.bf16])
def test_cuda_graph_decode_equals_eager_decode(checkpoint, dtype):
    graphs, eager, _ = slot_engines(checkpoint, dtype)
    assert graphs.slots.captured and not eager.slots.captured
    a, b = responses(graphs), responses(eager)  # 48 samples over 24 slots: refills and compaction
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert max_lp_diff(a, b) == 0.0  # the same kernels, replayed


def test_slot_decode_matches_the_padded_engine_in_fp32(checkpoint):
    graphs, _, padded = slot_engines(checkpoint, DType.fp32)
    a, b = responses(graphs), responses(padded)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert max_lp_diff(a, b) < 1e-4


def test_sampled_logprobs_match_the_full_forward(checkpoint):
    """What the trainer recomputes (one full forward over prompt + response) equals what the graph
    decode reported, within the dtype's tolerance."""
    from gpu_runs import full_forward_mismatch

    for dtype, tol in ((DType.fp32, 1e-4), (DType.bf16, 5e-2)):
        graphs, _, _ = slot_engines(checkpoint, dtype)
        mismatch = full_forward_mismatch(responses(graphs, n=2, temperature=1.0), checkpoint, graphs.dtype)
        assert mismatch < tol, (dtype, mismatch)


RECIPES = ["bf16", "fp8", "int4_qat", "bf16_train_fp8_rollout", "bf16_train_int4_rollout"]
MISMATCH: dict[str, float] = {}  # recipe -> mean mismatch over the 3 steps, for the QAT-vs-PTQ check


@pytest.mark.parametrize("recipe", RECIPES)
def test_grpo_smoke_run_on_cuda(compose, tmp_path, monkeypatch, recipe):
    """3 GRPO steps in-process on the GPU per precision recipe: first-step ppo_kl == 0, a checked
    sync every step, a finite mismatch (bf16: small)."""
    pytest.importorskip("hydra")
    from gpu_runs import run_inprocess

    monkeypatch.chdir(tmp_path)
    metrics = run_inprocess(compose, tmp_path, [
        "hardware=gpu", f"precision={recipe}", "steps=3", "warm_start.enabled=false", "eval.interval=3",
        "task.eval_size=16", "rollout.batch_size=8", "trainer.global_batch_size=64", "trainer.micro_batch_size=32"])
    assert metrics[1]["train/ppo_kl"] == 0.0 and metrics[1]["train/pg_clipfrac"] == 0.0
    mismatch = [metrics[s]["mismatch/logprob_abs_diff"] for s in (1, 2, 3)]
    assert all(0 < m < 1 for m in mismatch), mismatch
    if recipe == "bf16":
        assert max(mismatch) < 2e-2  # bf16 on both sides
    MISMATCH[recipe] = sum(mismatch) / 3
    if recipe == "bf16_train_int4_rollout" and "int4_qat" in MISMATCH:  # QAT: the trainer sees the rounding
        assert MISMATCH["int4_qat"] < MISMATCH[recipe], MISMATCH
    assert all(metrics[s]["perf/weight_sync_s"] > 0 for s in (1, 2, 3))  # checked (rollout.check_weight_sync)
    env = json.loads(Path(tmp_path / "run" / "env.json").read_text())
    assert env["hardware"]["gpus"] and env["hardware"]["gpus"][0]["name"]
