"""DSA (DeepSeek-V3.2, GLM-5) against transformers in the sparse regime: sequences of 40 tokens with
index_topk 8, so most queries drop most of their keys, for the full forward and the cache decode.

Exact ties in the index scores. A key's score is exactly 0.0 when the ReLU zeroes every indexer
head (q_h . k <= 0 for all h; about 2^-index_n_heads of the (query, key) pairs of a random model),
and when fewer than index_topk visible keys score above 0 (the head weights can be negative) the
top-k cut falls inside such a tie. Which tied keys win is then implementation-defined: DeepSeek's
reference (DeepSeek-V3.2-Exp inference/model.py, `Indexer.forward`) and transformers both call
torch.topk, whose CPU kernel (nth_element) picks differently for rows of different lengths, so
transformers' own cache decode differs from its own full forward there (measured with 4 indexer
heads: up to 4.1 in the logits from position 10 on, both families). Ours breaks such ties earliest
first (`topk_keep`) so that decode always equals the forward. Apart from tie-breaking the indexer
math is the same on both sides (scores agree to fp32 rounding), so the parity tests below use
tie-free models (16 indexer heads) and check that the top-k cut is separated by a clear margin.
The tied regime (4 indexer heads): `test_with_ties_the_only_difference_from_transformers_is_tie_breaking`
gives transformers an earliest-first topk and gets our logits; `test_decode_equals_forward_with_natural_ties`
checks our decode against our forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from miles.models import from_pretrained
from zoo_checks import check_decode_matches_forward, left_padded, max_diff, random_ids, tiny_hf_model

TOPK, LENGTH, VOCAB = 8, 40, 64
ATOL = 1e-5  # fp32 logits
MIN_GAP = 1e-5  # score margin at the top-k cut; scores ~0.1-1 differ across paths by ~1e-7

FAMILIES = {
    "deepseek_v32": dict(glm=False),
    "glm_moe_dsa": dict(glm=True),
    "glm_moe_dsa_shared": dict(glm=True, indexer_types=["full", "full", "shared"]),
}


def _hf_config(glm: bool, index_n_heads: int = 16, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                  n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                  qk_nope_head_dim=8, v_head_dim=8, index_n_heads=index_n_heads, index_head_dim=16,
                  index_topk=TOPK, first_k_dense_replace=1, routed_scaling_factor=2.5,
                  max_position_embeddings=128)
    if glm:
        return transformers.GlmMoeDsaConfig(**common, **extra)
    return transformers.DeepseekV32Config(**common, n_group=4, topk_group=2, **extra)


def _pair(tmp_path, glm: bool, index_n_heads: int = 16, **extra):
    """A random transformers model, saved, and ours loaded from its directory."""
    hf = tiny_hf_model(_hf_config(glm, index_n_heads, **extra))
    hf.save_pretrained(tmp_path / "hf")
    return hf, from_pretrained(tmp_path / "hf").eval()


def _cut_gaps(ours, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """Per indexer layer and query row with more than TOPK visible keys, the score gap between the
    TOPK-th and the next best visible key (0 = a tie at the cut). Flattened, float32."""
    seen = []

    def hook(module, args, _out):
        x, q_latent, ctx = args[:3]
        visible = ctx.mask()[:, 0].expand(x.shape[0], -1, -1)
        scores = module.scores(x, q_latent, ctx).masked_fill(~visible, float("-inf"))
        rows = visible.sum(-1) > TOPK
        best = scores[rows].topk(TOPK + 1, dim=-1).values
        seen.append(best[:, TOPK - 1] - best[:, TOPK])

    handles = [layer.self_attn.indexer.register_forward_hook(hook)
               for layer in ours.layers if layer.self_attn.indexer is not None]
    try:
        ours(ids, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return torch.cat(seen)


def _per_position(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).abs().amax(dim=(0, 2))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_full_forward_matches_transformers_past_index_topk(family, tmp_path):
    hf, ours = _pair(tmp_path, **FAMILIES[family])
    ids = random_ids(VOCAB, batch=2, length=LENGTH, seed=11)
    gaps = _cut_gaps(ours, ids)
    assert gaps.numel() >= 2 * 2 * (LENGTH - TOPK)  # every layer drops keys for every row past TOPK
    assert gaps.min() > MIN_GAP, f"near-tie at the top-k cut ({gaps.min():.3g}): pick another seed"

    logits = ours(ids)
    per_position = _per_position(logits, hf(ids).logits)
    assert per_position.max() < ATOL, per_position

    # not vacuous: the selection changes the output past TOPK (dense = same weights, topk >= length)
    dense = copy.deepcopy(ours)
    for layer in dense.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk = LENGTH
    effect = _per_position(logits, dense(ids))
    assert effect[:TOPK].max() < ATOL and (effect[TOPK + 1:] > 1e-2).all(), effect


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_cache_decode_matches_the_transformers_forward_past_index_topk(family, tmp_path):
    """Left-padded prefill of prompts (6, 13, 20 tokens), then one token per step up to 40 tokens
    for the longest row: every prefill position and every step equals transformers' full forward
    of that row's unpadded sequence."""
    hf, ours = _pair(tmp_path, **FAMILIES[family])
    prompts, new = (6, 13, 20), LENGTH - 20
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, VOCAB, (n + new,), generator=gen) for n in prompts]
    refs = [hf(s[None]).logits[0] for s in seqs]
    for s in seqs:
        gaps = _cut_gaps(ours, s[None])
        assert gaps.min() > MIN_GAP, f"near-tie at the top-k cut ({gaps.min():.3g}): pick another seed"

    ids, mask, pos = left_padded(seqs, prompts)
    width = ids.shape[1]
    cache = ours.new_cache(len(seqs), width + new)
    prefill = ours(ids, attention_mask=mask, position_ids=pos, cache=cache)
    worst = 0.0
    for i, n in enumerate(prompts):
        diff = max_diff(prefill[i, width - n:], refs[i][:n])
        assert diff < ATOL, f"prefill row {i} differs from transformers by {diff:.3g}"
        worst = max(worst, diff)
    for step in range(new):
        tok = torch.stack([s[n + step] for s, n in zip(seqs, prompts)])[:, None]
        mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=mask.dtype)], dim=1)
        out = ours(tok, attention_mask=mask, position_ids=pos[:, -1:] + 1 + step, cache=cache)[:, 0]
        for i, n in enumerate(prompts):
            diff = max_diff(out[i], refs[i][n + step])
            assert diff < ATOL, f"decode step {step} (position {n + step}) row {i} differs by {diff:.3g}"
            worst = max(worst, diff)
    assert worst < ATOL


@pytest.mark.parametrize("glm", [False, True], ids=["deepseek_v32", "glm_moe_dsa"])
@torch.no_grad()
def test_decode_equals_forward_with_natural_ties(glm, tmp_path):
    """4 indexer heads: exact 0.0 ties at the top-k cut occur (checked), which transformers breaks
    differently on its decode and forward paths; ours still decodes exactly its own forward."""
    _, ours = _pair(tmp_path, glm, index_n_heads=4)
    assert (_cut_gaps(ours, random_ids(VOCAB, batch=2, length=LENGTH, seed=11)) == 0).any()
    check_decode_matches_forward(ours, prompt_lens=(6, 13, 20), new_tokens=LENGTH - 20)


def _earliest_first_topk(self, k, dim=-1, largest=True, sorted=True):
    """torch.Tensor.topk with ties broken toward lower indices (a stable sort), like `topk_keep`."""
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_with_ties_the_only_difference_from_transformers_is_tie_breaking(family, tmp_path, monkeypatch):
    """4 indexer heads: with ties at the cut ours and transformers (torch.topk) differ by O(1) past
    index_topk; give transformers an earliest-first topk and it matches ours to fp32 rounding."""
    hf, ours = _pair(tmp_path, index_n_heads=4, **FAMILIES[family])
    ids = random_ids(VOCAB, batch=2, length=LENGTH, seed=11)
    assert (_cut_gaps(ours, ids) == 0).any()
    logits = ours(ids)
    monkeypatch.setattr(torch.Tensor, "topk", _earliest_first_topk)
    per_position = _per_position(logits, hf(ids).logits)
    assert per_position.max() < ATOL, per_position
