"""The fused W4A16 Triton kernel on CUDA against int4_linear: same weight bits, reordered fp32 sums only.

Skipped without a GPU (CI); run on a GPU machine with `pytest tests/gpu/test_int4_triton_cuda.py`.
"""

import pytest
import torch
import torch.nn.functional as F
from gpu_runs import captured

from miles.precision import dequantize_int4, int4_linear, pack_int4, quantize_int4
from miles.precision import int4_triton
from miles.precision.int4_triton import TileConfig, int4_linear_auto, int4_linear_fused, pick_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not int4_triton.triton_available(), reason="needs triton")]

SHAPES = [(1024, 1024), (3072, 1024), (1024, 3072), (2560, 9728), (9728, 2560)]  # (N, K)


def _rel(a, ref):
    return ((a.float() - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def weights():
    cache = {}

    def get(n, k, group, seed=0):
        if (n, k, group) not in cache:
            g = torch.Generator(device="cuda").manual_seed(seed)
            w = torch.randn(n, k, device="cuda", generator=g) * 0.02
            q, s = quantize_int4(w, group)
            cache[(n, k, group)] = (pack_int4(q), s)
        return cache[(n, k, group)]

    return get


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("nk", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("m", [1, 7, 64, 300, 1024, 4096])
def test_matches_int4_linear(m, nk, group, weights):
    n, k = nk
    packed, scales = weights(n, k, group)
    x = torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m)).bfloat16()
    y = int4_linear_fused(x, packed, scales, group)
    ref4 = int4_linear(x, packed, scales, group)
    # fp32 GEMM of the very operands both multiply (the bf16-rounded dequantized weight).
    ref = F.linear(x.float(), dequantize_int4(packed, scales, group, k=k, dtype=torch.bfloat16).float())
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, ref4.float()) < 1e-2, pick_config(m, n, k)
    # Both only round the fp32 sum to bf16 (plus a reordering): equally far from the fp32 result.
    assert _rel(y, ref) <= 1.25 * _rel(ref4, ref) + 1e-4, (_rel(y, ref), _rel(ref4, ref))


ALT_CONFIGS = [None, TileConfig(16, 64, 64, 5, 4, 2), TileConfig(64, 128, 64, 1, 4, 3),
               TileConfig(16, 64, 256, 3, 4, 2, unpack=1), TileConfig(128, 128, 64, 1, 8, 3, unpack=1, swap=False),
               TileConfig(32, 64, 128, 2, 4, 2, unpack=0, swap=False)]
ALT_IDS = ["heuristic", "split5", "prefill-tiles", "shift-unpack", "shift-noswap", "join-noswap"]


@pytest.mark.parametrize("config", ALT_CONFIGS, ids=ALT_IDS)
@pytest.mark.parametrize("group", [32, 128])
def test_weight_bits_exact_through_identity(group, config):
    # x = I makes every output one product w[n, k] * 1 plus exact zeros: the output is the weight the
    # kernel multiplied, which must be dequantize_int4's bf16 value bit for bit (fp32 product, one RTNE).
    n, k = 200, 385  # odd K, K not a multiple of the group, N not a multiple of any tile
    w = torch.randn(n, k, device="cuda") * torch.exp2(torch.randint(-6, 6, (n, 1), device="cuda").float())
    q, s = quantize_int4(w, group)
    packed = pack_int4(q)
    y = int4_linear_fused(torch.eye(k, device="cuda", dtype=torch.bfloat16), packed, s, group, config=config)
    assert torch.equal(y, dequantize_int4(packed, s, group, k=k, dtype=torch.bfloat16).T)


@pytest.mark.parametrize("config", ALT_CONFIGS, ids=ALT_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,group", [(1, 70, 257, 32), (33, 130, 200, 128), (300, 96, 4096, 128)])
def test_edges_bias_and_leading_dims(m, n, k, group, dtype, config):
    w = torch.randn(n, k, device="cuda") * 0.05
    q, s = quantize_int4(w, group)
    packed = pack_int4(q)
    x = torch.randn(2, m, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    y = int4_linear_fused(x, packed, s, group, bias, config=config)
    ref4 = int4_linear(x, packed, s, group, bias)
    ref = F.linear(x.float(), dequantize_int4(packed, s, group, k=k, dtype=dtype).float(), bias.float())
    assert y.shape == (2, m, n) and y.dtype == dtype
    assert _rel(y, ref4.float()) < 1e-2
    assert _rel(y, ref) <= 1.25 * _rel(ref4, ref) + 1e-4


@pytest.mark.parametrize("m", [1, 64, 4096])
def test_bitwise_deterministic(m, weights):
    packed, scales = weights(2560, 9728, 128)
    x = torch.randn(m, 9728, device="cuda").bfloat16()
    bias = torch.randn(2560, device="cuda").bfloat16()
    assert m >= 4096 or pick_config(m, 2560, 9728).split_k > 1  # the split-K reduction is covered
    a = int4_linear_fused(x, packed, scales, 128, bias)
    b = int4_linear_fused(x, packed, scales, 128, bias)
    assert torch.equal(a, b)


@pytest.mark.parametrize("m", [1, 64])
def test_cuda_graph_capture(m, weights):
    packed, scales = weights(1024, 3072, 32)
    x = torch.randn(m, 3072, device="cuda").bfloat16()
    graph, y = captured(lambda: int4_linear_fused(x, packed, scales, 32))
    for seed in (1, 2):
        x.copy_(torch.randn(m, 3072, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, int4_linear_fused(x, packed, scales, 32))


def test_auto_dispatch_on_cuda(weights):
    packed, scales = weights(1024, 1024, 128)
    x = torch.randn(5, 1024, device="cuda").bfloat16()
    assert torch.equal(int4_linear_auto(x, packed, scales, 128), int4_linear_fused(x, packed, scales, 128))
    big = torch.randn(int4_triton.FUSED_MAX_ROWS + 1, 1024, device="cuda").bfloat16()  # prefill: int4_linear
    assert torch.equal(int4_linear_auto(big, packed, scales, 128), int4_linear(big, packed, scales, 128))
    x32 = x.float()  # not a kernel dtype: the reference path, bitwise
    assert torch.equal(int4_linear_auto(x32, packed, scales, 128), int4_linear(x32, packed, scales, 128))
