"""CausalLM behaviour: KV-cache decoding equals the full forward, padding is invisible to
real tokens, cache bookkeeping, and dtype-agnostic execution.

Tolerance: fp32 logits, atol 1e-5. Cached and full paths run identical math on tensors of
different shapes, so they differ only by float rounding (~1e-7 here).
"""

import pytest
import torch

from miles.models import ArchConfig, CausalLM

ATOL = 1e-5
VOCAB = 64
PROMPT_LENS = (3, 5, 7)
NEW_TOKENS = 4
PAD_ID = 0


def _model(tied: bool = False, qk_norm: bool = True) -> CausalLM:
    cfg = ArchConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        qk_norm=qk_norm,
        attention_bias=not qk_norm,
        family="qwen3" if qk_norm else "qwen2",
    )
    model = CausalLM(cfg, seed=0).eval()
    # Non-trivial norms and biases so that every code path influences the logits.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def _sequences(seed: int = 2) -> list[torch.Tensor]:
    """One sequence per prompt length: prompt followed by NEW_TOKENS continuation tokens."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n + NEW_TOKENS,), generator=gen) for n in PROMPT_LENS]


def _left_pad(prompts: list[torch.Tensor], pad_id: int = PAD_ID):
    """ids, mask: [B, max_len] with prompts right-aligned; positions = cumsum(mask) - 1 clipped at 0."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def _reference(model: CausalLM, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each row's logits from an unpadded, uncached forward: [len, V] per sequence."""
    return [model(s[None])[0] for s in seqs]


@torch.no_grad()
def _decode(model: CausalLM, seqs, chunks, rows=None):
    """Prefill the left-padded prompts, then feed the continuation in `chunks` (sizes summing to
    NEW_TOKENS) through the cache. If `rows` is given, the batch is reduced / reordered to those
    rows with ModelCache.select after the prefill. Returns (prefill logits, continuation logits
    [B, NEW_TOKENS, V], prompt mask, row order)."""
    ids, mask, pos = _left_pad([s[: len(s) - NEW_TOKENS] for s in seqs])
    cache = model.new_cache(len(seqs), ids.shape[1] + NEW_TOKENS)
    prefill = model(ids, attention_mask=mask, position_ids=pos, cache=cache)
    assert cache.length == ids.shape[1]
    order = torch.arange(len(seqs))
    if rows is not None:
        order = torch.tensor(rows)
        cache.select(order)
        mask, pos = mask[order], pos[order]
    cont = torch.stack([seqs[i][len(seqs[i]) - NEW_TOKENS :] for i in order.tolist()])
    next_pos = pos[:, -1:] + 1
    out, start = [], 0
    for size in chunks:
        mask = torch.cat([mask, torch.ones(len(order), size, dtype=mask.dtype)], dim=1)
        step_pos = next_pos + torch.arange(start, start + size)
        out.append(model(cont[:, start : start + size], attention_mask=mask, position_ids=step_pos, cache=cache))
        start += size
    assert cache.length == mask.shape[1]
    return prefill, torch.cat(out, dim=1), order


@pytest.mark.parametrize("tied,qk_norm", [(False, True), (True, True), (False, False)])
def test_prefill_then_token_by_token_decode_matches_full_forward(tied, qk_norm):
    model = _model(tied=tied, qk_norm=qk_norm)
    seqs = _sequences()
    refs = _reference(model, seqs)
    prefill, cont, _ = _decode(model, seqs, chunks=[1] * NEW_TOKENS)

    width = max(PROMPT_LENS)
    for i, n in enumerate(PROMPT_LENS):
        assert (prefill[i, width - n :] - refs[i][:n]).abs().max() < ATOL
        assert (cont[i] - refs[i][n:]).abs().max() < ATOL
    assert torch.isfinite(prefill).all()  # pad rows too: they must not poison batch sums


def test_multi_token_chunks_through_cache_match_full_forward():
    model = _model()
    seqs = _sequences(seed=3)
    refs = _reference(model, seqs)
    _, cont, _ = _decode(model, seqs, chunks=[2, 1, 1])
    for i, n in enumerate(PROMPT_LENS):
        assert (cont[i] - refs[i][n:]).abs().max() < ATOL


def test_cache_select_keeps_and_reorders_rows():
    model = _model()
    seqs = _sequences(seed=4)
    refs = _reference(model, seqs)
    _, cont, order = _decode(model, seqs, chunks=[1] * NEW_TOKENS, rows=[2, 0])
    for row, i in enumerate(order.tolist()):
        assert (cont[row] - refs[i][PROMPT_LENS[i] :]).abs().max() < ATOL


@torch.no_grad()
def test_padding_does_not_change_real_token_logits():
    model = _model()
    seqs = _sequences(seed=5)
    refs = _reference(model, seqs)
    # Left padding (rollout layout) with positions counted from the first real token.
    ids, mask, pos = _left_pad(seqs)
    logits = model(ids, attention_mask=mask, position_ids=pos)
    width = ids.shape[1]
    for i, s in enumerate(seqs):
        assert (logits[i, width - len(s) :] - refs[i]).abs().max() < ATOL
    # Whatever sits in the pad slots is invisible to real tokens.
    garbage = torch.where(mask.bool(), ids, torch.randint_like(ids, VOCAB))
    assert (model(garbage, attention_mask=mask, position_ids=pos) - logits)[mask.bool()].abs().max() < ATOL
    # Right padding (training layout) with default positions 0..T-1.
    right_ids = torch.stack([torch.cat([s, torch.full((width - len(s),), PAD_ID)]) for s in seqs])
    right_mask = torch.flip(mask, dims=[1])
    right = model(right_ids, attention_mask=right_mask)
    for i, s in enumerate(seqs):
        assert (right[i, : len(s)] - refs[i]).abs().max() < ATOL


@torch.no_grad()
def test_without_mask_pads_are_attended():
    """Guards the test above: the mask is what hides the pads."""
    model = _model()
    seqs = _sequences(seed=6)
    ids, mask, pos = _left_pad(seqs)
    unmasked = model(ids, position_ids=pos)
    assert (unmasked[0, -1] - _reference(model, seqs)[0][-1]).abs().max() > 1e-3


def test_cache_overflow_and_bad_mask_shape_raise():
    model = _model()
    ids = torch.randint(0, VOCAB, (2, 4))
    with pytest.raises(ValueError, match="overflow"):
        model(ids, cache=model.new_cache(2, 3))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(ids, attention_mask=torch.ones(2, 5))
    cache = model.new_cache(2, 8)
    model(ids, cache=cache)
    with pytest.raises(ValueError, match=r"\(2, 5\)"):
        model(ids[:, :1], attention_mask=torch.ones(2, 1), position_ids=torch.full((2, 1), 4), cache=cache)


def test_new_cache_shapes_and_tied_head():
    model = _model(tied=True)
    cache = model.new_cache(3, 10, dtype=torch.bfloat16)
    assert len(cache.layers) == 2
    assert cache.layers[0].keys.shape == (3, 2, 10, 16) and cache.layers[0].keys.dtype == torch.bfloat16
    assert model.lm_head is None
    assert "lm_head.weight" not in model.state_dict()
    untied = _model(tied=False)
    n_tied = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in untied.parameters()) - n_tied == VOCAB * 32


def test_init_weights_is_seeded():
    a, b, c = (CausalLM(_model().config, seed=s) for s in (11, 11, 12))
    assert torch.equal(a.layers[1].mlp.up_proj.weight, b.layers[1].mlp.up_proj.weight)
    assert not torch.equal(a.layers[1].mlp.up_proj.weight, c.layers[1].mlp.up_proj.weight)
    assert torch.equal(a.norm.weight, torch.ones(32))
    std = a.layers[0].mlp.gate_proj.weight.std().item()
    assert 0.015 < std < 0.025


@torch.no_grad()
def test_bfloat16_weights_and_autocast_track_fp32():
    model = _model()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    ref = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = model(ids)
    bf16 = model.to(torch.bfloat16)
    cache = bf16.new_cache(2, 6)
    decoded = bf16(ids, cache=cache)
    assert decoded.dtype == torch.bfloat16 and cache.layers[0].keys.dtype == torch.bfloat16
    # bf16 has ~3 significant digits; logits here are O(1).
    for out in (autocast, decoded):
        assert torch.isfinite(out).all()
        assert (out.float() - ref).abs().max() < 0.1
