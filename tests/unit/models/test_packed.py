"""Packed rows (several sequences per row, segment_ids + restarting positions) give each sequence
the hidden states of its own unpadded forward; the variable-length layout (cu_seqlens) matches the
segments. The varlen path's layout handling (flattening, block bounds, GQA) is checked on the CPU
against a per-block SDPA standing in for the kernel; on CUDA the kernel itself equals masked SDPA
in value and gradient, GQA included.

Tolerance: fp32 CPU, atol 1e-5 (same math, other shapes: float rounding only); CUDA bf16, 2e-2.
"""

import pytest
import torch
import torch.nn.functional as F

import miles.models.packed as packed
from miles.models import ArchConfig, CausalLM
from miles.models.context import ForwardContext, causal_mask
from miles.models.packed import layout_from_segments, packed_attention, uses_varlen, varlen_layout

VOCAB = 50


def _model() -> CausalLM:
    cfg = ArchConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qk_norm=True, family="qwen3")
    return CausalLM(cfg, seed=0).eval()


def _pack(seqs: list[list[torch.Tensor]], width: int):
    """Rows of sequences -> ids, segment_ids, position_ids [R, width] (tails: id 0, segment 0)."""
    ids, seg, pos = (torch.zeros(len(seqs), width, dtype=torch.long) for _ in range(3))
    for r, row in enumerate(seqs):
        off = 0
        for j, s in enumerate(row):
            ids[r, off:off + len(s)], seg[r, off:off + len(s)] = s, j + 1
            pos[r, off:off + len(s)] = torch.arange(len(s))
            off += len(s)
    return ids, seg, pos


def test_packed_rows_equal_each_sequence_alone():
    model = _model()
    gen = torch.Generator().manual_seed(0)
    rows = [[torch.randint(1, VOCAB, (n,), generator=gen) for n in lens] for lens in ([5, 3, 4], [7], [2, 2])]
    ids, seg, pos = _pack(rows, 12)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, segment_ids=seg)
        hidden = model(ids, position_ids=pos, segment_ids=seg, return_hidden=True)
        for r, row in enumerate(rows):
            off = 0
            for s in row:
                alone = model(s[None])[0]
                torch.testing.assert_close(packed[r, off:off + len(s)], alone, atol=1e-5, rtol=1e-5)
                off += len(s)
        torch.testing.assert_close(F.linear(hidden, model.output_weight), packed,
                                   atol=1e-6, rtol=1e-6)


def test_layout_from_segments_splits_at_sequences_rows_and_tails():
    _, seg, _ = _pack([[torch.ones(5), torch.ones(3)], [torch.ones(7)], [torch.ones(2), torch.ones(2)]], 9)
    cu, longest = layout_from_segments(seg)
    # row 0: 5 + 3 + tail 1; row 1: 7 + tail 2; row 2: 2 + 2 + tail 5
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 8, 9, 16, 18, 20, 22, 27]
    assert longest == 7


def _blockwise_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, enable_gqa=False, window_size=None, is_causal=None):
    """varlen_attn's contract, one causal SDPA per block: q [total, H, D], k / v [total, Hkv, D]."""
    assert window_size == (-1, 0) or is_causal
    assert torch.equal(cu_q, cu_k) and int((cu_q[1:] - cu_q[:-1]).max()) == max_q == max_k
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        blk = [x[a:b].transpose(0, 1)[None] for x in (q, k, v)]
        out[a:b] = F.scaled_dot_product_attention(*blk, is_causal=True, enable_gqa=enable_gqa)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("with_layout", [True, False])
def test_varlen_path_equals_masked_path(monkeypatch, with_layout):
    model = _model()
    gen = torch.Generator().manual_seed(3)
    rows = [[torch.randint(1, VOCAB, (n,), generator=gen) for n in lens] for lens in ([5, 3], [7], [2, 2, 1])]
    ids, seg, pos = _pack(rows, 9)
    with torch.no_grad():
        masked = model(ids, position_ids=pos, segment_ids=seg)
        monkeypatch.setattr(packed, "uses_varlen", lambda *_: True)
        monkeypatch.setattr(packed, "_varlen_attn", lambda: _blockwise_varlen)
        if with_layout:  # what the trainer hands over
            with varlen_layout(*layout_from_segments(seg)):
                out = model(ids, position_ids=pos, segment_ids=seg)
        else:
            out = model(ids, position_ids=pos, segment_ids=seg)
    real = (seg > 0)[..., None]
    torch.testing.assert_close(out * real, masked * real, atol=1e-5, rtol=1e-5)


def test_varlen_kernel_only_where_flash_runs():
    assert not uses_varlen(torch.device("cpu"), torch.bfloat16, 128)
    assert not uses_varlen(torch.device("cuda"), torch.float32, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_varlen_equals_masked_sdpa_on_cuda(kv_heads):
    torch.manual_seed(0)
    b, h, t, d = 2, 8, 64, 128
    seg = torch.zeros(b, t, dtype=torch.long, device="cuda")
    seg[0, :20], seg[0, 20:50], seg[1, :64] = 1, 2, 1  # row 0 has a 14-token tail
    q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kv_heads, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kv_heads, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ctx = ForwardContext(torch.zeros(b, t, dtype=torch.long, device="cuda"), None, 0, segment_ids=seg)
    cu, longest = layout_from_segments(seg)
    with varlen_layout(cu, longest):
        out = packed_attention(q, k, v, ctx, gqa=kv_heads != h)
    mask = causal_mask(None, 0, t, q.device, segment_ids=seg)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=kv_heads != h)
    real = (seg > 0)[:, None, :, None]
    torch.testing.assert_close(out.float() * real, ref * real, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(ref) * real
    got = torch.autograd.grad(out.float(), (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=3e-2, rtol=3e-2)
