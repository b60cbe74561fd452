"""miles.precision on CUDA: the quantizers agree with the CPU bit for bit; scaled_mm matches emulated.

Skipped without a GPU (CI); run on a GPU machine with `pytest tests/gpu/test_precision_cuda.py`.
"""

import pytest
import torch

from miles.precision import (
    dequantize_fp8_weight,
    dequantize_int4,
    fake_fp8_linear,
    fp8_backend_report,
    fp8_linear,
    int4_linear,
    pack_int4,
    quantize_fp8_act,
    quantize_fp8_weight,
    quantize_int4,
    resolve_fp8_backend,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("shape", [(576, 7168), (130, 257), (3, 4, 300)])
def test_quantizers_bitwise_equal_cpu_gpu(shape):
    g = torch.Generator().manual_seed(0)
    mag = torch.exp2(torch.randint(-8, 8, shape[:-1], generator=g).float())[..., None]
    w = torch.randn(*shape, generator=g) * mag
    for dtype in (torch.float32, torch.bfloat16):
        wc = w.to(dtype)
        wg = wc.cuda()
        for a, b in zip(quantize_fp8_weight(wc), quantize_fp8_weight(wg)):
            assert torch.equal(_bits(a), _bits(b))
        for a, b in zip(quantize_fp8_act(wc), quantize_fp8_act(wg)):
            assert torch.equal(_bits(a), _bits(b))
        for group in (32, 128):
            (qc, sc), (qg, sg) = quantize_int4(wc, group), quantize_int4(wg, group)
            assert torch.equal(_bits(pack_int4(qc)), _bits(pack_int4(qg))) and torch.equal(_bits(sc), _bits(sg))
            assert torch.equal(_bits(dequantize_int4(pack_int4(qc), sc, group, k=shape[-1], dtype=dtype)),
                               _bits(dequantize_int4(pack_int4(qg), sg, group, k=shape[-1], dtype=dtype)))
        qc, sc = quantize_fp8_weight(wc)
        assert torch.equal(_bits(dequantize_fp8_weight(qc, sc, dtype)),
                           _bits(dequantize_fp8_weight(qc.cuda(), sc.cuda(), dtype)))


def test_emulated_on_gpu_is_the_training_forward():
    x = torch.randn(64, 384, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    y = fp8_linear(x, *quantize_fp8_weight(w), backend="emulated")
    assert torch.equal(y, fake_fp8_linear(x, w))
    q, s = quantize_int4(w, 128)
    assert torch.equal(int4_linear(x, pack_int4(q), s, 128), torch.nn.functional.linear(
        x, dequantize_int4(pack_int4(q), s, 128, dtype=torch.bfloat16)))


def test_scaled_mm_matches_emulated_on_hopper():
    report = fp8_backend_report("cuda")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"DeepSeek-style blockwise scaled_mm is SM90-only in torch; report: {report}")
    assert report["scaled_mm"].startswith("ok"), report
    assert resolve_fp8_backend("auto", "cuda") in ("scaled_mm", "deep_gemm")
    for m, n, k in [(4096, 576, 7168), (33, 200, 300), (1, 4096, 2048), (8, 512, 2048), (200, 768, 2048)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q, s = quantize_fp8_weight(torch.randn(n, k, device="cuda"))
        y = fp8_linear(x, q, s, backend="scaled_mm")
        ref = fp8_linear(x, q, s, backend="emulated", out_dtype=torch.float32)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2, (m, n, k)
