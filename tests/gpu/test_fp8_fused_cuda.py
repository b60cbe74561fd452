"""Unified FP8 on CUDA: the fused activation quantizer is the torch quantizer bit for bit, the
trainer's FP8 layer gives the engine's bits, and a whole 0.6B-shaped model's train / rollout
mismatch under the w8a8 scheme against bf16's (an expected failure: w8a8 measured 5.6x bf16's; fp8's
default scheme, w8a16, is held to bf16's level in test_fp8_w8a16_cuda.py).

Skipped without a GPU (CI). On a GPU machine: `pytest -s tests/gpu/test_fp8_fused_cuda.py`."""

import pytest
import torch

from miles.precision import quantize_fp8_act, quantize_fp8_weight
from miles.precision.fp8 import _pad
from miles.precision.fp8_gemm import fp8_backend_report, fp8_linear_with, prepare_fp8_weight
from miles.precision.fp8_train import FP8WeightCache, fp8_train_linear
from miles.precision.fp8_triton import quantize_act_fused

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("m,k,kp", [(1, 1024, 1024), (64, 3072, 3072), (33, 300, 384), (4096, 2560, 2560)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_act_quantizer_is_bitwise_the_torch_one(m, k, kp, dtype):
    g = torch.Generator(device="cuda").manual_seed(m + k)
    # Rows of very different magnitudes, a zero tile, values at the fp8 rounding boundaries' scale.
    x = torch.randn(m, k, device="cuda", generator=g) * torch.exp2(torch.randint(-12, 12, (m, 1), device="cuda",
                                                                                 generator=g).float())
    x[0, :128] = 0
    x = x.to(dtype)
    q, s = quantize_act_fused(x, kp)
    mp = q.shape[0]
    q_ref, s_ref = quantize_fp8_act(_pad(x, (0, kp - k, 0, mp - m)))
    assert mp % 16 == 0 and mp >= m and s.stride() == (1, mp)
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(_bits(s), _bits(s_ref))


@pytest.mark.parametrize("n,k", [(1024, 1024), (3072, 1024), (1024, 3072), (200, 300)])
def test_trainer_fp8_layer_gives_the_engine_layers_bits(n, k):
    g = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02  # the fp32 master weight
    b = torch.randn(n, device="cuda", generator=g)
    x = torch.randn(2, 37, k, device="cuda", generator=g).to(torch.bfloat16)
    engine = fp8_linear_with(x, prepare_fp8_weight(*quantize_fp8_weight(w)), b.to(torch.bfloat16))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        trainer = fp8_train_linear(x, w.requires_grad_(), b, FP8WeightCache())
    assert torch.equal(trainer, engine)
    trainer.float().sum().backward()  # the backward runs (bf16) and reaches the master weight
    assert w.grad is not None and w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


def test_auto_backend_is_a_real_fp8_gemm_on_hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("blockwise FP8 GEMMs are SM90 kernels here")
    report = fp8_backend_report("cuda")
    print(report)
    assert prepare_fp8_weight(*quantize_fp8_weight(torch.randn(256, 256, device="cuda"))).backend != "emulated"


RUN = ["hardware=gpu", "model=qwen3_0_6b", "steps=1", "warm_start.enabled=false", "eval.interval=1000",
       "task.eval_size=16", "rollout.batch_size=32", "trainer.global_batch_size=256", "rollout.max_new_tokens=128"]


@pytest.mark.xfail(strict=True, reason="w8a8 (issue 33): measured 2026-12-03 on an H200, fp8 w8a8 4.3e-2 "
                   "(forward_weights=rollout 3.4e-2, + rollout.compile=false 2.4e-2) vs bf16 7.6e-3 with "
                   "identical per-layer FP8 arithmetic; the 1x128 activation quantizer amplifies the two "
                   "sides' upstream differences; exactly 0 in true on-policy mode "
                   "(test_fp8_invariant_cuda.py, docs/precision.md); fp8's default scheme, w8a16, meets it "
                   "(test_fp8_w8a16_cuda.py: 7.89e-3 vs 7.77e-3)")
def test_w8a8_mismatch_is_no_larger_than_bf16s(compose, tmp_path, monkeypatch):
    """One step per recipe through the real loop (random weights, the same prompts and seed): the
    trainer's log-probs of the engine's samples against the engine's, averaged over 32 x 8 x 128
    tokens, with the training forward on the fp32 masters (default) and on the weights in the
    engine's dtype (precision.forward_weights=rollout). Measured before the trainer ran the
    engine's FP8 GEMM: 4.31e-2 (fp8) vs 7.66e-3 (bf16)."""
    pytest.importorskip("hydra")
    from gpu_runs import run_inprocess

    monkeypatch.chdir(tmp_path)
    mismatch = {}
    for recipe in ("bf16", "fp8"):
        for weights in ("master", "rollout"):
            run = tmp_path / f"{recipe}_{weights}"
            run.mkdir()
            scheme = ["precision.fp8_scheme=w8a8"] if recipe == "fp8" else []
            metrics = run_inprocess(compose, run, [*RUN, f"precision={recipe}", *scheme,
                                                   f"precision.forward_weights={weights}"])
            mismatch[recipe, weights] = metrics[1]["mismatch/logprob_abs_diff"]
            assert metrics[1]["train/ppo_kl"] == 0.0
    print({f"{r} {w}": f"{v:.3e}" for (r, w), v in mismatch.items()})
    assert mismatch["fp8", "rollout"] <= mismatch["bf16", "master"], mismatch
