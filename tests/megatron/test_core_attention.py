"""The project's core attention (miles/trainer/megatron/core_attention.py) against megatron-core's own
local `DotProductAttention` (fp32, random inputs, forward and gradients) and, for MLA's qk head dim !=
v head dim that the local one cannot take, against softmax attention written out by hand."""

import pytest
import torch


@pytest.fixture(scope="module")
def parallel(megatron_on_this_device):
    import miles.trainer.megatron.trainer as megatron_trainer

    megatron_trainer.init_parallel(torch.device("cuda"))  # gloo on the CPU (cuda_on_cpu maps it)
    return megatron_on_this_device


def _config(heads: int, groups: int, channels: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * channels, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=channels, attention_dropout=0.0,
                             attention_softmax_in_fp32=True, masked_softmax_fusion=False)


def _qkv(s, b, heads, groups, k, v, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(s, b, heads, k), (s, b, groups, k), (s, b, groups, v)]
    return [torch.randn(shape, generator=g).to(device).requires_grad_() for shape in shapes]


def _both(mask_type, heads, groups):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from miles.trainer.megatron.core_attention import SDPACoreAttention

    config = _config(heads, groups, 8)
    return (SDPACoreAttention(config, 1, mask_type, "self"), DotProductAttention(config, 1, mask_type, "self"))


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])  # MHA, GQA, MQA
def test_causal_equals_megatron_dot_product_attention(heads, groups, parallel):
    from megatron.core.transformer.enums import AttnMaskType

    ours, theirs = _both(AttnMaskType.causal, heads, groups)
    s, b = 12, 3
    causal = torch.ones(s, s, dtype=torch.bool, device=parallel).triu(1)[None, None]  # what the trainer passes
    q, k, v = _qkv(s, b, heads, groups, 8, 8, parallel)
    got, want = ours(q, k, v, causal), theirs(q, k, v, causal)
    assert got.shape == want.shape == (s, b, heads * 8)
    assert float((got - want).abs().max()) < 1e-5
    grads = [torch.autograd.grad(out, (q, k, v), torch.ones_like(out)) for out in (got, want)]
    assert max(float((a - b).abs().max()) for a, b in zip(*grads)) < 1e-5
    assert float((ours(q, k, v, None) - want).abs().max()) < 1e-5  # causal without a mask tensor


def test_padding_mask_equals_megatron_dot_product_attention(parallel):
    from megatron.core.transformer.enums import AttnMaskType

    ours, theirs = _both(AttnMaskType.padding, 4, 2)
    s, b = 10, 2
    g = torch.Generator().manual_seed(1)
    masked = torch.rand(b, 1, s, s, generator=g) < 0.4
    masked[..., 0] = False  # every query sees at least one key
    masked = masked.to(parallel)
    q, k, v = _qkv(s, b, 4, 2, 8, 8, parallel, seed=2)
    assert float((ours(q, k, v, masked) - theirs(q, k, v, masked)).abs().max()) < 1e-5


def test_mla_head_dims_equal_softmax_attention_by_hand(parallel):
    """k_channels 12 (qk nope + rope), v_channels 8, the MLA softmax scale: as MLASelfAttention builds it."""
    from megatron.core.transformer.enums import AttnMaskType

    from miles.trainer.megatron.core_attention import SDPACoreAttention

    heads, s, b, kd, vd, scale = 4, 9, 2, 12, 8, 0.37
    attn = SDPACoreAttention(_config(heads, heads, 8), 1, AttnMaskType.causal, "self", softmax_scale=scale,
                             k_channels=kd, v_channels=vd)
    q, k, v = _qkv(s, b, heads, heads, kd, vd, parallel, seed=3)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=parallel).triu(1), float("-inf"))
    want = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v).reshape(s, b, heads * vd)
    got = attn(q, k, v, None)
    assert got.shape == (s, b, heads * vd)
    assert float((got - want).abs().max()) < 1e-5


@pytest.mark.parametrize("padded", [False, True])
def test_packed_sequences_equal_each_sequence_alone(padded, parallel):
    """THD: three sequences (lengths 5, 1, 4) packed, GQA, MLA-like k / v dims; with `padded` each
    sequence starts at a multiple of 4 (cu_seqlens_q_padded) and the gaps come back as zeros."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from miles.trainer.megatron.core_attention import SDPACoreAttention

    heads, groups, kd, vd = 4, 2, 12, 8
    attn = SDPACoreAttention(_config(heads, groups, 8), 1, AttnMaskType.padding_causal, "self", k_channels=kd,
                             v_channels=vd)
    lengths, starts = [5, 1, 4], ([0, 8, 12, 16] if padded else [0, 5, 6, 10])
    q, k, v = (t[:, 0] for t in _qkv(starts[-1], 1, heads, groups, kd, vd, parallel, seed=4))  # [t, h, d]
    cu = torch.tensor([0, 5, 6, 10], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=torch.tensor(starts, dtype=torch.int32) if padded else None,
                             cu_seqlens_kv_padded=torch.tensor(starts, dtype=torch.int32) if padded else None)
    got = attn(q, k, v, None, packed_seq_params=params)
    assert got.shape == (starts[-1], heads * vd)
    filled = torch.zeros(starts[-1], dtype=torch.bool)
    for start, n in zip(starts, lengths):
        alone = attn(*(t[start:start + n, None] for t in (q, k, v)), None, attn_mask_type=AttnMaskType.causal)
        assert float((got[start:start + n] - alone[:, 0]).abs().max()) < 1e-6
        filled[start:start + n] = True
    assert not got[~filled].any()  # the gaps between padded sequences (none unpadded)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the variable-length kernel runs on CUDA")
@pytest.mark.parametrize("heads,groups,kd,vd", [(8, 2, 64, 64), (4, 4, 192, 128)], ids=["gqa", "mla"])
def test_packed_bf16_on_cuda_takes_the_varlen_kernel_and_computes_the_same(heads, groups, kd, vd, parallel,
                                                                           monkeypatch):
    """CUDA, bf16: a causal THD pack goes through torch's variable-length kernel (no per-sequence
    loop), and its output and gradients are the per-sequence SDPA's, both against fp32 attention of
    the same bf16 inputs within bf16 rounding (MLA: the value padded to the query's width, as
    megatron-core's MLA hands THD values over)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from miles.trainer.megatron.core_attention import SDPACoreAttention

    attn = SDPACoreAttention(_config(heads, groups, kd), 1, AttnMaskType.causal, "self", k_channels=kd, v_channels=kd)
    cu = torch.tensor([0, 37, 38, 102, 122], dtype=torch.int32, device="cuda")
    pad = [0, kd - vd]
    q, k, v = (t[:, 0].detach().bfloat16() for t in _qkv(122, 1, heads, groups, kd, vd, "cuda", seed=5))
    calls = []
    varlen = SDPACoreAttention._varlen
    monkeypatch.setattr(SDPACoreAttention, "_varlen", lambda self, *a: calls.append(1) or varlen(self, *a))

    def run(params, dtype):
        grads = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = attn(grads[0], grads[1], torch.nn.functional.pad(grads[2], pad), None, packed_seq_params=params)
        out = out.view(122, heads, kd)[..., :vd]
        out.float().square().sum().backward()
        return [out.float()] + [g.grad.float() for g in grads]

    fast = run(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=64, max_seqlen_kv=64),
               torch.bfloat16)
    assert calls == [1]
    # cu_seqlens_q_padded (equal bounds, another tensor) keeps the per-sequence path
    slow = run(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu.clone(),
                               max_seqlen_q=64, max_seqlen_kv=64), torch.bfloat16)
    exact = run(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=64,
                                max_seqlen_kv=64), torch.float32)
    assert calls == [1]
    for a, b, ref in zip(fast, slow, exact):
        scale = float(ref.abs().max())
        err_fast, err_slow = float((a - ref).abs().max()) / scale, float((b - ref).abs().max()) / scale
        print(f"\nvarlen {err_fast:.3g}, per-sequence SDPA {err_slow:.3g} (relative to fp32)")
        assert err_fast < 2e-2 and err_slow < 2e-2, (err_fast, err_slow)


def test_the_local_decoder_spec_builds_the_projects_core_attention(parallel):
    """Every layer of the non-TE block spec (dense and MoE layers alike) swaps DotProductAttention out."""
    from megatron.core.transformer import TransformerConfig

    from miles.trainer.megatron.core_attention import SDPACoreAttention
    from miles.trainer.megatron.specs import decoder_block_spec

    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                               moe_layer_freq=[0, 1, 1], moe_ffn_hidden_size=16)
    block = decoder_block_spec(config, te=False, layer_spec={"normalization": "RMSNorm", "rope_theta": 1e6})
    cores = [layer.submodules.self_attention.submodules.core_attention for layer in block.layer_specs]
    assert [(core.module, core.params) for core in cores] == [(SDPACoreAttention, {"rope_theta": 1e6})] * 3


def _megatron_rope(x, theta):
    """megatron-core's own RoPE (RotaryEmbedding + apply_rotary_pos_emb, unfused, bshd) of x
    [s, b, h, d] at positions 0..s-1 (one sequence): what GPTModel does without the swap."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    freqs = RotaryEmbedding(x.shape[-1], rotary_percent=1.0, rotary_base=theta)(x.shape[0]).to(x.device)
    return _apply_rotary_pos_emb_bshd(x, freqs[: x.shape[0]])


def test_rope_in_the_core_attention_equals_megatrons(parallel):
    """With `rope_theta` the core attention rotates query and key as megatron-core's RoPE does, then
    attends: padded rows (positions 0..s-1) and a THD pack (positions restarting per sequence)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from miles.trainer.megatron.core_attention import SDPACoreAttention, packed_positions

    theta, (heads, groups) = 10000.0, (4, 2)
    plain = SDPACoreAttention(_config(heads, groups, 8), 1, AttnMaskType.causal, "self")
    rotating = SDPACoreAttention(_config(heads, groups, 8), 1, AttnMaskType.causal, "self", rope_theta=theta)
    q, k, v = _qkv(12, 3, heads, groups, 8, 8, parallel, seed=6)
    want = plain(_megatron_rope(q, theta), _megatron_rope(k, theta), v, None)
    assert float((rotating(q, k, v, None) - want).abs().max()) < 1e-6
    assert float((plain(q, k, v, None) - want).abs().max()) > 1e-2  # the rotation matters here

    cu = torch.tensor([0, 5, 6, 12], dtype=torch.int32, device=parallel)
    assert packed_positions(cu, 12).tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    qt, kt, vt = (t[:, 0] for t in (q, k, v))  # [t, h, d]
    got = rotating(qt, kt, vt, None, packed_seq_params=params)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = plain(*(_megatron_rope(t[start:end, None], theta) for t in (qt, kt)), vt[start:end, None], None)
        assert float((got[start:end] - alone[:, 0]).abs().max()) < 1e-6
