"""The batch-invariant FP8 GEMM on CUDA and the FP8 / INT4 recipes in true on-policy mode.

- fp8_gemm_invariant: every output row has the same bits whatever the row count of the call and
  whichever tile config computes it (decode 64-row tiles, training 128-row tiles), and it is the
  emulated GEMM's value up to fp32 summation order; torch._scaled_mm is checked for the same property
  and its answer printed (the reason true on-policy cannot use it).
- `precision=fp8 true_on_policy=true` (w8a16, and w8a8) and `precision=int4_qat true_on_policy=true`: the trainer's
  log-probs equal the engine's bit for bit on every step of a run of the tiny dense and MoE models.

Skipped without a GPU (CI). On a GPU machine: `pytest -s tests/gpu/test_fp8_invariant_cuda.py`."""

import pytest
import torch

from miles.precision import quantize_fp8_weight
from miles.precision.fp8_gemm import _quantize_for_triton, fp8_linear, prepare_fp8_weight, fp8_linear_with
from miles.precision.fp8_triton_gemm import CONFIGS, fp8_gemm_invariant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _operands(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=g) * torch.exp2(
        torch.randint(-6, 6, (m, 1), device="cuda", generator=g).float())).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    return x, *quantize_fp8_weight(w)


@pytest.mark.parametrize("n,k", [(1024, 1024), (3072, 1024), (1024, 3072), (300, 1000), (9728, 2560)])
def test_rows_do_not_depend_on_the_row_count_or_the_tile_config(n, k):
    x, qw, sw = _operands(4096, n, k, seed=n + k)
    xq, xs = _quantize_for_triton(x)
    configs = [cfg for _, cfg in CONFIGS]
    full = fp8_gemm_invariant(xq, xs, qw, sw, 4096, torch.bfloat16, configs[-1])
    for config in configs:
        for rows in (1, 3, 64, 65, 500, 4096):
            part = fp8_gemm_invariant(xq, xs, qw, sw, rows, torch.bfloat16, config)
            assert torch.equal(part, full[:rows]), (config, rows)
    # The default path (fp8_linear on the "triton" backend) picks a config by M: the same bits again.
    for rows in (1, 64, 300):
        assert torch.equal(fp8_linear_with(x[:rows], prepare_fp8_weight(qw, sw, "triton")), full[:rows])


@pytest.mark.parametrize("n,k", [(1024, 1024), (300, 1000)])
def test_the_value_is_the_emulated_gemms(n, k):
    x, qw, sw = _operands(777, n, k, seed=7)
    emulated = fp8_linear(x, qw, sw, backend="emulated", out_dtype=torch.float32)
    out = fp8_linear(x, qw, sw, backend="triton", out_dtype=torch.float32)
    err = ((out - emulated).norm() / emulated.norm()).item()
    print(f"triton vs emulated fp32: {err:.2e}")
    assert err < 1e-3  # same products; fp32 sums reordered (and the MMA's own accumulation), below bf16's 4e-3


def test_scaled_mm_rows_depend_on_the_row_count_or_not():
    """Not an assertion on cuBLASLt: prints whether its rows change with M (why true on-policy runs
    the Triton GEMM instead)."""
    x, qw, sw = _operands(4096, 3072, 1024, seed=1)
    try:
        w = prepare_fp8_weight(qw, sw, "scaled_mm")
    except RuntimeError as e:
        pytest.skip(str(e))
    full = fp8_linear_with(x, w)
    print({rows: torch.equal(fp8_linear_with(x[:rows], w), full[:rows]) for rows in (1, 16, 64, 256, 1024)})


@pytest.mark.parametrize("precision", [["precision=fp8"], ["precision=fp8", "precision.fp8_scheme=w8a8"],
                                       ["precision=int4_qat"]], ids=["fp8", "fp8-w8a8", "int4_qat"])
@pytest.mark.parametrize("model", ["qwen3_tiny", "qwen3_moe_tiny"])
def test_quantized_true_on_policy_is_exact_on_cuda(compose, tmp_path, monkeypatch, model, precision):
    pytest.importorskip("hydra")
    from gpu_runs import run_inprocess

    steps = 5
    monkeypatch.chdir(tmp_path)
    metrics = run_inprocess(compose, tmp_path, [
        f"model={model}", "hardware=gpu", *precision, "true_on_policy=true", f"steps={steps}",
        "warm_start.enabled=false", f"eval.interval={steps}", "task.eval_size=16", "rollout.batch_size=8",
        "trainer.global_batch_size=64", "trainer.micro_batch_size=32", "algo.entropy_coef=0.01"])
    diffs = [metrics[s]["mismatch/logprob_abs_diff"] for s in range(1, steps + 1)]
    assert diffs == [0.0] * steps, diffs
    assert metrics[1]["train/ppo_kl"] == 0.0
