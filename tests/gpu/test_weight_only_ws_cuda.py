"""The warp-specialized weight-only GEMMs (miles/precision/weight_only_ws.py) on a Hopper GPU: close to
cuBLAS on the dequantized weight at the 4B layer shapes, the weight's bits through an identity, tails
in M and N, bias, CUDA graphs.
The bits against the trainer's GEMM are counted by `benchmarks/weight_only_ws.py` (a result, not an
assertion, until the kernel has run).

Skipped without an sm_90 GPU (CI). On the GPU machine: `pytest -s tests/gpu/test_weight_only_ws_cuda.py`
(scripts/gpu_session.sh 19)."""

import pytest
import torch
import torch.nn.functional as F
from gpu_runs import captured

from miles.precision import fp8_w8a16_triton, int4_triton
from miles.precision import weight_only_ws as ws
from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight
from miles.precision.int4 import dequantize_int4, pack_int4, quantize_int4

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU"),
              pytest.mark.skipif(ws.gluon is None, reason="needs triton's Gluon")]

SHAPES_4B = [(4096 + 2 * 1024, 2560), (2560, 4096), (2 * 9728, 2560), (2560, 9728)]  # (N, K): qkv, o, gate_up, down


def _operands(fmt, n, k, seed=0):
    """(codes, scales, the bf16 weight they dequantize to)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    if fmt == "w8a16":
        q, s = quantize_fp8_weight(w)
        return q, s, dequantize_fp8_weight(q, s, torch.bfloat16)
    codes, s = quantize_int4(w, 128)
    packed = pack_int4(codes)
    return packed, s, dequantize_int4(packed, s, 128, k=k, dtype=torch.bfloat16)


def _rel(a, ref):
    return ((a.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("fmt", ["w8a16", "w4a16"])
@pytest.mark.parametrize("config", sorted(ws.CONFIGS))
@pytest.mark.parametrize("m", [256, 300, 512])
@pytest.mark.parametrize("n,k", SHAPES_4B)
def test_matches_linear_on_the_dequantized_weight(fmt, config, m, n, k):
    codes, s, w = _operands(fmt, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = ws.weight_only_ws_linear(x, codes, s, fmt, config=config)
    ref16 = F.linear(x, w)
    ref = F.linear(x.float(), w.float())
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, ref) <= 1.25 * _rel(ref16, ref) + 1e-4  # as close to fp32 as cuBLAS's bf16 GEMM


@pytest.mark.parametrize("fmt", ["w8a16", "w4a16"])
def test_weight_bits_through_identity(fmt):
    codes, s, w = _operands(fmt, 2560, 4096, seed=1)
    eye = torch.eye(4096, dtype=torch.bfloat16, device="cuda")[:256]  # the first 256 columns of W^T
    assert torch.equal(ws.weight_only_ws_linear(eye, codes, s, fmt), w[:, :256].T)


@pytest.mark.parametrize("fmt", ["w8a16", "w4a16"])
def test_tails_and_bias(fmt):
    n, k = 1000, 2560  # N not a multiple of the 128-row tile, M not one of the row tile
    codes, s, w = _operands(fmt, n, k, seed=2)
    x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = ws.weight_only_ws_linear(x, codes, s, fmt, bias)
    ref = F.linear(x.float(), w.float(), bias.float())
    assert _rel(y, ref) <= 1.25 * _rel(F.linear(x, w, bias), ref) + 1e-4


@pytest.mark.parametrize("fmt", ["w8a16", "w4a16"])
def test_captured_in_a_cuda_graph_equals_eager(fmt):
    codes, s, _ = _operands(fmt, 6144, 2560, seed=3)
    x = torch.randn(512, 2560, device="cuda", dtype=torch.bfloat16)
    graph, out = captured(lambda: ws.weight_only_ws_linear(x, codes, s, fmt))
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, ws.weight_only_ws_linear(x, codes, s, fmt))  # deterministic: no atomics
