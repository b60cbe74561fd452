"""FP8 e4m3 blockwise quantization: error bounds, layout, zero blocks, odd shapes, determinism.

Error bound used below, per element, for s = block scale and v = w / s in [-448, 448]:
e4m3 has 3 mantissa bits, so for a normal v (|v| >= 2^-6) round-to-nearest is off by at most half an
ULP, 2^-4 |v|; for a subnormal v the spacing is 2^-9, so at most 2^-10. Scaling back by s:
    |w - dq| <= 2^-4 |w| + 2^-10 s      (plus fp32 rounding of the division and product, ~2^-23 relative).
"""

import pytest
import torch
import torch.nn.functional as F

from miles.precision import (
    FP8_DTYPE,
    dequantize_fp8_act,
    dequantize_fp8_weight,
    quantize_fp8_act,
    quantize_fp8_weight,
)
from miles.precision.fp8 import expand_block_scale

SLACK = 1 + 2.0**-20


def _varied_weight(n, k, seed=0):
    """Gaussian weights whose 128x128 blocks differ in magnitude by up to 2^12 (realistic outliers)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-6, 7, (-(-n // 128), -(-k // 128)), generator=g).float())
    return torch.randn(n, k, generator=g) * expand_block_scale(mag, n, k)


def _bound_ok(w, dq, s_elem):
    err = (w - dq).abs()
    bound = (2.0**-4 * w.abs() + 2.0**-10 * s_elem) * SLACK
    return bool((err <= bound).all()), err, bound


def _reference_weight_quant(w):
    """Independent slow reference: loop over blocks."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    s = torch.empty(-(-n // 128), -(-k // 128))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = blk.abs().max()
            sc = amax / torch.tensor(448.0) if amax > 0 else torch.tensor(1.0)
            s[i, j] = sc
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / sc).clamp(-448, 448).to(FP8_DTYPE)
    return q, s


@pytest.mark.parametrize("shape", [(256, 384), (130, 257), (1, 5), (128, 129), (300, 128)])
def test_weight_error_bound_and_shapes(shape):
    w = _varied_weight(*shape)
    q, s = quantize_fp8_weight(w)
    assert q.shape == w.shape and q.dtype == FP8_DTYPE
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and s.dtype == torch.float32
    dq = dequantize_fp8_weight(q, s)
    ok, err, bound = _bound_ok(w, dq, expand_block_scale(s, *shape))
    assert ok, f"max excess {(err - bound).max()}"


def test_bound_is_tight_for_normal_values():
    # The half-ULP bound is attained (up to sampling): the worst normal-range relative error is close to 2^-4.
    w = _varied_weight(512, 512, seed=1)
    q, s = quantize_fp8_weight(w)
    dq = dequantize_fp8_weight(q, s)
    normal = (w.abs() / expand_block_scale(s, 512, 512)) >= 2.0**-6
    rel = ((w - dq).abs() / w.abs())[normal]
    assert 0.9 * 2.0**-4 < rel.max() <= 2.0**-4 * SLACK


def test_matches_slow_reference_bitwise():
    w = _varied_weight(200, 300, seed=2)
    q, s = quantize_fp8_weight(w)
    q_ref, s_ref = _reference_weight_quant(w)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_block_uses_full_range():
    # Each non-zero block's largest |q| is exactly 448: the scale is amax / 448, not a looser power of two.
    w = _varied_weight(256, 256, seed=3)
    q, _ = quantize_fp8_weight(w)
    qa = q.float().abs().reshape(2, 128, 2, 128).amax(dim=(1, 3))
    assert torch.equal(qa, torch.full((2, 2), 448.0))


def test_subnormal_values_within_bound():
    w = torch.zeros(128, 128)
    w[0, 0] = 448.0  # scale 1.0, so small entries land in e4m3's subnormal range (< 2^-6)
    w[1:, 0] = torch.linspace(1e-4, 2.0**-6, 127)
    q, s = quantize_fp8_weight(w)
    assert s.item() == 1.0
    ok, _, _ = _bound_ok(w, dequantize_fp8_weight(q, s), torch.ones_like(w))
    assert ok


def test_zero_blocks():
    w = _varied_weight(256, 256)
    w[:128, 128:] = 0.0
    q, s = quantize_fp8_weight(w)
    assert s[0, 1].item() == 1.0  # zero block: scale 1, not 0 (no 0/0, exact dequantization)
    assert not torch.isnan(q.float()).any()
    dq = dequantize_fp8_weight(q, s)
    assert torch.equal(dq[:128, 128:], torch.zeros(128, 128))
    q0, s0 = quantize_fp8_weight(torch.zeros(3, 7))
    assert torch.equal(q0.float(), torch.zeros(3, 7)) and torch.equal(s0, torch.ones(1, 1))


def test_tiny_block_whose_scale_underflows():
    w = torch.zeros(4, 4)
    w[0, 0] = 1e-44  # amax / 448 underflows to 0 in fp32
    q, s = quantize_fp8_weight(w)
    assert torch.isfinite(s).all() and not torch.isnan(q.float()).any()


def test_padding_invariance():
    # A non-multiple shape quantizes exactly like its explicit zero padding, cropped.
    w = _varied_weight(130, 257, seed=4)
    q, s = quantize_fp8_weight(w)
    qp, sp = quantize_fp8_weight(F.pad(w, (0, 384 - 257, 0, 256 - 130)))
    assert torch.equal(s, sp)
    assert torch.equal(q.view(torch.uint8), qp[:130, :257].view(torch.uint8))


def test_leading_dims_are_batched():
    w = torch.stack([_varied_weight(130, 200, seed=i) for i in range(3)])  # stacked MoE experts [E, N, K]
    q, s = quantize_fp8_weight(w)
    assert q.shape == w.shape and s.shape == (3, 2, 2)
    for e in range(3):
        qe, se = quantize_fp8_weight(w[e])
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(s[e], se)
    assert torch.equal(dequantize_fp8_weight(q, s)[1], dequantize_fp8_weight(q[1], s[1]))


def test_bf16_input_is_quantized_from_its_exact_fp32_value():
    w = _varied_weight(128, 256).to(torch.bfloat16)
    q, s = quantize_fp8_weight(w)
    q2, s2 = quantize_fp8_weight(w.float())
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert dequantize_fp8_weight(q, s, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(4, 256), (2, 3, 200), (7, 1)])
def test_activation_tiles(shape):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=g) * 10
    q, s = quantize_fp8_act(x)
    assert q.shape == x.shape and s.shape == (*shape[:-1], -(-shape[-1] // 128))
    dq = dequantize_fp8_act(q, s)
    s_elem = s.repeat_interleave(128, -1)[..., : shape[-1]]
    ok, _, _ = _bound_ok(x, dq, s_elem)
    assert ok
    # Tiles are per token: one row's outlier does not change another row's scale.
    x2 = x.clone()
    x2.reshape(-1, shape[-1])[0, 0] = 1e6
    _, s2 = quantize_fp8_act(x2)
    assert torch.equal(s2.reshape(-1, s.shape[-1])[1:], s.reshape(-1, s.shape[-1])[1:])


def test_deterministic():
    w = _varied_weight(300, 500, seed=6)
    a, b = quantize_fp8_weight(w), quantize_fp8_weight(w)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
    x = torch.randn(33, 500)
    c, d = quantize_fp8_act(x), quantize_fp8_act(x)
    assert torch.equal(c[0].view(torch.uint8), d[0].view(torch.uint8)) and torch.equal(c[1], d[1])


def test_dequantize_fast_path_equals_the_generic_formula():
    # Block-divisible shapes broadcast the scale over a block view; the bits equal the expanded formula.
    w = _varied_weight(256, 384, seed=8)
    q, s = quantize_fp8_weight(w)
    for dtype in (torch.float32, torch.bfloat16):
        generic = (q.float() * expand_block_scale(s, 256, 384)).to(dtype)
        assert torch.equal(dequantize_fp8_weight(q, s, dtype), generic)
    x = torch.randn(5, 256)
    qa, sa = quantize_fp8_act(x)
    assert torch.equal(dequantize_fp8_act(qa, sa), qa.float() * sa.repeat_interleave(128, -1))


def test_float64_input_is_quantized_as_fp32():
    w = _varied_weight(128, 128, seed=9)
    a, b = quantize_fp8_weight(w.double()), quantize_fp8_weight(w)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
