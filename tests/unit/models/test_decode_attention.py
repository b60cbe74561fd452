"""The slot-decode attention kernel (miles/models/decode_attention.py) against SDPA with the slot mask,
on the CPU through the Triton interpreter (a subprocess with TRITON_INTERPRET=1: triton picks
interpreting or compiling at import); on a CUDA machine the same cases run compiled, and
tests/gpu/test_decode_attention_cuda.py runs the engine with and without it."""

import os

import pytest
import torch

from triton_interpreter import run_under_interpreter

from miles.models import decode_attention as da
from miles.models.attention import grouped_decode_attention
from miles.models.context import slot_mask

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHILD = os.environ.get("TRITON_INTERPRET") == "1"
RUNS_KERNEL = da.triton is not None and (DEV == "cuda" or (CHILD and da._interpreting()))
needs_kernel = pytest.mark.skipif(not RUNS_KERNEL, reason="kernel tests run on CUDA or in the interpreter subprocess")


@pytest.mark.skipif(DEV != "cpu" or CHILD or da.triton is None, reason="only the CPU parent starts it")
def test_kernels_under_interpreter():
    run_under_interpreter(__file__)


def _operands(b, h, hkv, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g) * 2  # peaked softmaxes as well as flat ones
    k = torch.randn(b, hkv, s, d, generator=g)
    v = torch.randn(b, hkv, s, d, generator=g)
    return [t.to(dtype).to(DEV) for t in (q, k, v)]


def _reference(q, k, v, past):
    """SDPA over the slot mask, in fp32 on the same (rounded) inputs."""
    mask = slot_mask(past, k.shape[2])
    return grouped_decode_attention(q.float(), k.float(), v.float(), mask)


# (rows, heads, kv heads, columns, head dim, each row's past): GQA groups of 4 and 8, MHA; pasts at
# 0, inside / at the end of a 64-column block, and the last column.
CASES = [(4, 8, 2, 128, 64, [0, 63, 64, 127]), (3, 16, 2, 192, 128, [5, 100, 191]), (2, 4, 4, 64, 64, [10, 63])]


@needs_kernel
@pytest.mark.parametrize("splits", [1, 3, None], ids=["unsplit", "split3", "heuristic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,hkv,s,d,pasts", CASES)
def test_matches_sdpa_over_the_slot_mask(b, h, hkv, s, d, pasts, dtype, splits):
    q, k, v = _operands(b, h, hkv, s, d, dtype)
    past = torch.tensor(pasts, device=DEV)
    out = da.slot_decode_attention(q, k, v, past, splits=splits)
    ref = _reference(q, k, v, past)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # p and the output rounded to the value dtype
    assert (out.float() - ref).abs().max().item() < tol


@needs_kernel
def test_columns_past_the_live_prefix_are_never_read():
    q, k, v = _operands(2, 8, 2, 128, 64, torch.bfloat16, seed=1)
    past = torch.tensor([3, 70], device=DEV)
    before = da.slot_decode_attention(q, k, v, past)
    k2, v2 = k.clone(), v.clone()
    for row, p in enumerate(past.tolist()):
        k2[row, :, p + 1:], v2[row, :, p + 1:] = float("nan"), float("nan")
    assert torch.equal(da.slot_decode_attention(q, k2, v2, past), before)


@needs_kernel
def test_one_live_column_returns_its_value_exactly():
    """softmax over one column is 1: each query head gets its KV head's first value, bit for bit."""
    q, k, v = _operands(3, 8, 2, 64, 128, torch.bfloat16, seed=2)
    out = da.slot_decode_attention(q, k, v, torch.zeros(3, dtype=torch.long, device=DEV))
    expected = v[:, :, :1].repeat_interleave(4, dim=1)
    assert torch.equal(out, expected)


@needs_kernel
def test_rows_of_a_larger_buffer_and_a_deterministic_split():
    """The decode graphs pass views of the first rows of the slot buffers; repeated calls give the same bits."""
    q, k, v = _operands(6, 8, 2, 192, 64, torch.bfloat16, seed=3)
    past = torch.tensor([150, 2, 191, 64], device=DEV)
    out = da.slot_decode_attention(q[:4], k[:4], v[:4], past, splits=3)
    assert torch.equal(out, da.slot_decode_attention(q[:4].clone(), k[:4].clone(), v[:4].clone(), past, splits=3))
    assert (out.float() - _reference(q[:4], k[:4], v[:4], past)).abs().max().item() < 1e-2


def test_split_heuristic_fills_the_gpu_and_stays_within_the_columns():
    assert da.splits_for(programs=4096, columns=384, sms=132) == 1  # 512 rows x 8 KV heads
    assert da.splits_for(programs=64, columns=8192, sms=132) == 5  # ceil(264 / 64)
    assert da.splits_for(programs=8, columns=8192, sms=132) == da.MAX_SPLITS
    assert da.splits_for(programs=8, columns=100, sms=132) == 2  # two 64-column blocks


def test_cpu_tensors_and_batch_invariant_numerics_keep_sdpa():
    q, k, _ = _operands(1, 8, 2, 64, 64, torch.bfloat16)
    if DEV == "cpu":
        assert not da.applies(q, k)
    from miles.precision import invariance

    with invariance.on():
        assert not da.applies(q.to(DEV), k.to(DEV))
