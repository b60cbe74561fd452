"""FP8 weight-only (precision.fp8_scheme=w8a16) on CUDA: the fused W8A16 kernel on the 4B layer
shapes from decode to prefill rows, inside a CUDA graph, the trainer's layer against the engine's,
and the whole-model train / rollout mismatch against bf16's (issue 33's target for FP8 recipes).

Skipped without a GPU (CI). On a GPU machine: `pytest -s tests/gpu/test_fp8_w8a16_cuda.py`
(tests/unit/precision/test_fp8_w8a16_triton.py runs compiled there too)."""

import pytest
import torch
import torch.nn.functional as F
from gpu_runs import captured

from miles.precision import fp8_w8a16_triton as wt
from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight
from miles.precision.fp8_train import FP8WeightCache, straight_through_dequantized

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not wt.triton_available(), reason="needs triton")]

SHAPES_4B = [(4096 + 2 * 1024, 2560), (2560, 4096), (2 * 9728, 2560), (2560, 9728)]  # (N, K): qkv, o, gate_up, down


def _operands(n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return quantize_fp8_weight(torch.randn(n, k, device="cuda", generator=g) * 0.02)


def _rel(a, ref):
    return ((a.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("m", [1, 16, 64, 256, 512, 1024])
@pytest.mark.parametrize("n,k", SHAPES_4B)
def test_fused_matches_linear_on_the_dequantized_weight(m, n, k):
    q, s = _operands(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = wt.w8a16_linear_fused(x, q, s)
    ref16 = wt.w8a16_linear(x, q, s)
    ref = F.linear(x.float(), dequantize_fp8_weight(q, s, torch.bfloat16).float())
    assert _rel(y, ref16.float()) < 1e-2
    assert _rel(y, ref) <= 1.25 * _rel(ref16, ref) + 1e-4  # as close to fp32 as cuBLAS's bf16 GEMM


def test_weight_bits_through_identity_on_a_real_shape():
    n, k = 2560, 4096
    q, s = _operands(n, k, seed=1)
    eye = torch.eye(k, dtype=torch.bfloat16, device="cuda")[:256]  # the first 256 columns of W^T
    y = wt.w8a16_linear_fused(eye, q, s)
    assert torch.equal(y, dequantize_fp8_weight(q, s, torch.bfloat16)[:, :256].T)


def test_captured_in_a_cuda_graph_equals_eager():
    q, s = _operands(2 * 9728, 2560, seed=2)
    x = torch.randn(64, 2560, device="cuda", dtype=torch.bfloat16)
    eager = wt.w8a16_linear_auto(x, q, s)
    graph, out = captured(lambda: wt.w8a16_linear_auto(x, q, s))
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, wt.w8a16_linear_auto(x, q, s))  # deterministic: no atomics
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("m", [1, 64, 512])
def test_trainer_layer_agrees_with_the_engine_layer(m):
    """The trainer's w8a16 forward (F.linear on the cached dequantized weight under autocast) and the
    engine's fused kernel multiply the same weight values: they differ by fp32 summation order only,
    as two bf16 GEMMs do (the bf16 recipe's engine / trainer difference)."""
    w = torch.randn(2560, 9728, device="cuda") * 0.02
    x = torch.randn(m, 9728, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_fp8_weight(w)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        trainer = F.linear(x, straight_through_dequantized(w, FP8WeightCache(), torch.bfloat16))
    engine = wt.w8a16_linear_auto(x, q, s)
    bf16_pair = (F.linear(x, w.bfloat16()), F.linear(x.float(), w.bfloat16().float()))
    assert trainer.dtype == engine.dtype == torch.bfloat16
    assert _rel(engine, trainer.float()) <= 2 * _rel(bf16_pair[0], bf16_pair[1]) + 1e-4


@pytest.mark.parametrize("m", [1, 16, 64, 256])
@pytest.mark.parametrize("n,k", SHAPES_4B)
def test_decode_rows_count_few_bf16_roundings_off_the_prefill_gemm(n, k, m):
    """The decode kernel sums K in one pass, as cuBLAS's prefill-sized GEMM does: its rows of a
    4096-row batch, computed alone at decode size, should come out as the batch GEMM gives them.
    Bound: at most as many bf16 outputs off the batch GEMM as cuBLAS's own decode-sized GEMM has (the
    bf16 recipe's decode). On an H100, 2026-12-06: 0 off at every shape, cuBLAS's decode-sized GEMM
    up to 2,963 of 655,360 (256 rows of the 9728-deep down projection)."""
    q, s = _operands(n, k, seed=3)
    batch = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    w = dequantize_fp8_weight(q, s, torch.bfloat16)
    prefill = F.linear(batch, w)[:m]  # the trainer's / prefill's GEMM: cuBLAS at 4096 rows
    decode = wt.w8a16_linear_auto(batch[:m].contiguous(), q, s)
    cublas_decode = F.linear(batch[:m].contiguous(), w)
    off, cublas_off = int((decode != prefill).sum()), int((cublas_decode != prefill).sum())
    print(f"m={m} n={n} k={k}: fused {off}, cuBLAS {cublas_off} of {prefill.numel()} outputs off the batch GEMM")
    assert off <= cublas_off, (off, cublas_off)


RUN = ["hardware=gpu", "model=qwen3_0_6b", "steps=1", "warm_start.enabled=false", "eval.interval=1000",
       "task.eval_size=16", "rollout.batch_size=32", "trainer.global_batch_size=256", "rollout.max_new_tokens=128"]


def test_w8a16_mismatch_is_at_bf16s_level(compose, tmp_path, monkeypatch):
    """One step per recipe through the real loop (random 0.6B-shaped weights, the same prompts and
    seed): the fp8 w8a16 recipe's train / rollout mismatch is no larger than bf16's (issue 33). On an
    H100, 2026-12-06: 6.164e-3 against 6.215e-3; 7.24e-3 (1.16x) while the fused decode kernel split K
    (miles/precision/fp8_w8a16_triton.py says why it no longer does). w8a8 measured 5.7x bf16 on this
    shape (test_fp8_fused_cuda.py)."""
    pytest.importorskip("hydra")
    from gpu_runs import run_inprocess

    monkeypatch.chdir(tmp_path)
    mismatch = {}
    for name, overrides in (("bf16", ["precision=bf16"]), ("w8a16", ["precision=fp8"])):  # w8a16: fp8's default
        run = tmp_path / name
        run.mkdir()
        metrics = run_inprocess(compose, run, [*RUN, *overrides])
        mismatch[name] = metrics[1]["mismatch/logprob_abs_diff"]
        assert metrics[1]["train/ppo_kl"] == 0.0
    print({k: f"{v:.3e}" for k, v in mismatch.items()})
    assert mismatch["w8a16"] <= mismatch["bf16"], mismatch
