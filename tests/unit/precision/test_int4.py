"""INT4 W4A16: group quantization bound, nibble packing, dequantize, int4_linear."""

import pytest
import torch
import torch.nn.functional as F

from miles.precision import dequantize_int4, int4_linear, pack_int4, quantize_int4, unpack_int4


def _w(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-5, 6, (n, 1), generator=g).float())


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("shape", [(64, 256), (33, 200), (5, 31)])
def test_error_bound_half_a_step(group, shape):
    w = _w(*shape)
    q, s = quantize_int4(w, group)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert s.shape == (shape[0], -(-shape[1] // group)) and s.dtype == torch.float32
    assert q.abs().max() <= 7
    dq = dequantize_int4(pack_int4(q), s, group, k=shape[1])
    s_elem = s.repeat_interleave(group, -1)[:, : shape[1]]
    # |w - dq| <= s / 2 (round to nearest), up to fp32 rounding of w / s and q * s.
    assert ((w - dq).abs() <= s_elem / 2 * (1 + 2.0**-20) + 2.0**-22 * w.abs()).all()


def test_scale_is_group_amax_over_7_and_uses_the_full_range():
    w = _w(16, 256, seed=1)
    q, s = quantize_int4(w, 32)
    amax = w.abs().reshape(16, 8, 32).amax(-1)
    assert torch.equal(s, amax / torch.full_like(amax, 7.0))
    assert torch.equal(q.abs().reshape(16, 8, 32).amax(-1), torch.full((16, 8), 7, dtype=torch.int8))


def test_zero_group():
    w = _w(4, 64)
    w[:, :32] = 0
    q, s = quantize_int4(w, 32)
    assert torch.equal(s[:, 0], torch.ones(4)) and (q[:, :32] == 0).all()
    assert torch.equal(dequantize_int4(pack_int4(q), s, 32)[:, :32], torch.zeros(4, 32))


def test_pack_nibble_order_documented():
    # Even element -> low nibble, odd element -> high nibble, stored as q + 8.
    packed = pack_int4(torch.tensor([[1, -2, -7, 7]], dtype=torch.int8))
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[(1 + 8) | ((-2 + 8) << 4), (-7 + 8) | ((7 + 8) << 4)]]


@pytest.mark.parametrize("k", [2, 7, 64, 129])
def test_pack_unpack_round_trip_exact(k):
    g = torch.Generator().manual_seed(k)
    q = torch.randint(-8, 8, (3, 5, k), generator=g, dtype=torch.int8)  # every code, leading dims
    packed = pack_int4(q)
    assert packed.shape == (3, 5, -(-k // 2))
    assert torch.equal(unpack_int4(packed, k), q)
    # and every byte value unpacks / re-packs to itself
    allbytes = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    assert torch.equal(pack_int4(unpack_int4(allbytes, 512)), allbytes)


def test_bad_arguments():
    with pytest.raises(ValueError, match="group"):
        quantize_int4(torch.randn(4, 64), 64)
    q, s = quantize_int4(torch.randn(4, 64), 32)
    with pytest.raises(ValueError, match="scales"):
        dequantize_int4(pack_int4(q), s, 128)
    with pytest.raises(ValueError, match="packed"):
        unpack_int4(pack_int4(q), 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_is_dequantize_then_matmul(dtype):
    w = _w(48, 256, seed=2)
    q, s = quantize_int4(w, 128)
    packed = pack_int4(q)
    x = torch.randn(2, 5, 256).to(dtype)
    b = torch.randn(48).to(dtype)
    y = int4_linear(x, packed, s, 128, bias=b)
    ref = F.linear(x, dequantize_int4(packed, s, 128, dtype=dtype), b)
    assert y.dtype == dtype and y.shape == (2, 5, 48)
    assert torch.equal(y, ref)


def test_leading_dims_and_determinism():
    w = torch.stack([_w(8, 96, seed=i) for i in range(3)])
    q, s = quantize_int4(w, 32)
    for e in range(3):
        qe, se = quantize_int4(w[e], 32)
        assert torch.equal(q[e], qe) and torch.equal(s[e], se)
    q2, s2 = quantize_int4(w, 32)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    assert torch.equal(pack_int4(q), pack_int4(q2))


def test_dequantize_fast_path_equals_the_generic_formula():
    w = _w(16, 256, seed=3)
    for group in (32, 128):
        q, s = quantize_int4(w, group)
        for dtype in (torch.float32, torch.bfloat16):
            generic = (q.float() * s.repeat_interleave(group, -1)).to(dtype)
            assert torch.equal(dequantize_int4(pack_int4(q), s, group, dtype=dtype), generic)
