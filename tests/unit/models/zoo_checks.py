"""Checks every model family must pass, shared by the per-family test modules.

Parity: `transformers` builds a tiny random model of the family (all weights randomized, norms and
biases included, so a dropped or swapped tensor changes the logits), saves it, our loader reads the
directory alone and our logits match theirs in float32; our own save is loaded by `transformers`
with no missing or unexpected tensors and the same logits; save -> load is bitwise; and KV-cache
decoding (prefill of left-padded prompts, then token-by-token steps) equals the full forward.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from miles.models import CausalLM, from_pretrained, save_pretrained

ATOL = 1e-5  # fp32 logits; both sides run the same math in a different op order (~1e-7 apart)


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    """Every parameter ~ N(0, scale), vectors (norms, biases) around 1 so that none is inert."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if p.ndim == 1 else 0.0))


def tiny_hf_model(hf_config: transformers.PretrainedConfig, seed: int = 0, scale: float = 0.2):
    """A random transformers model of `hf_config` with eager attention (the reference math)."""
    torch.manual_seed(seed)
    hf_config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    randomize(model, seed, scale)
    return model


def random_ids(vocab: int, batch: int = 2, length: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def backward_nodes(t: torch.Tensor) -> list[str]:
    """The class names of every autograd node behind t (each node once)."""
    seen, todo, names = set(), [t.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@torch.no_grad()
def check_loads_transformers_checkpoint(hf_model, tmp_path: Path, atol: float = ATOL) -> CausalLM:
    """transformers save -> our from_pretrained: same logits. Returns our model."""
    hf_model.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    ids = random_ids(hf_model.config.vocab_size)
    diff = max_diff(ours(ids), hf_model(ids).logits)
    assert diff < atol, f"logits differ from transformers by {diff:.3g} (atol {atol})"
    return ours


@torch.no_grad()
def check_transformers_loads_ours(ours: CausalLM, tmp_path: Path, atol: float = ATOL) -> None:
    """our save_pretrained -> transformers from_pretrained: nothing missing, same logits; and our
    own save -> load round trip is bitwise."""
    save_pretrained(ours, tmp_path / "ours")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    # transformers would silently randomly initialize anything it did not find.
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    hf.config._attn_implementation = "eager"
    ids = random_ids(ours.config.vocab_size, seed=5)
    diff = max_diff(ours(ids), hf.eval()(ids).logits)
    assert diff < atol, f"transformers on our checkpoint differs by {diff:.3g}"

    loaded = from_pretrained(tmp_path / "ours")
    assert loaded.config == ours.config
    a, b = ours.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@torch.no_grad()
def check_decode_matches_forward(model: CausalLM, prompt_lens=(3, 5, 7), new_tokens: int = 4,
                                 atol: float = ATOL, seed: int = 2) -> None:
    """Left-padded prefill then one token per step through the cache equals each sequence's
    unpadded full forward, at every position; a mid-decode row reorder (cache.select) too."""
    model = model.eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (n + new_tokens,), generator=gen) for n in prompt_lens]
    refs = [model(s[None])[0] for s in seqs]
    ids, mask, pos = left_padded(seqs, prompt_lens)
    width = ids.shape[1]
    cache = model.new_cache(len(seqs), width + new_tokens)
    prefill = model(ids, attention_mask=mask, position_ids=pos, cache=cache)
    for i, n in enumerate(prompt_lens):
        diff = max_diff(prefill[i, width - n:], refs[i][:n])
        assert diff < atol, f"prefill row {i} differs from the full forward by {diff:.3g}"
    order = torch.arange(len(seqs)).flip(0)  # reorder rows once, as the rollout engine may
    cache.select(order)
    mask, pos = mask[order], pos[order]
    next_pos = pos[:, -1:] + 1
    for step in range(new_tokens):
        tok = torch.stack([seqs[i][prompt_lens[i] + step] for i in order.tolist()])[:, None]
        mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=mask.dtype)], dim=1)
        out = model(tok, attention_mask=mask, position_ids=next_pos + step, cache=cache)[:, 0]
        for row, i in enumerate(order.tolist()):
            diff = max_diff(out[row], refs[i][prompt_lens[i] + step])
            assert diff < atol, f"decode step {step} row {i} differs from the full forward by {diff:.3g}"


def left_padded(seqs, prompt_lens):
    """(ids, attention mask, positions) of each sequence's first prompt_lens tokens, left-padded."""
    width = max(prompt_lens)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, n in enumerate(prompt_lens):
        ids[i, width - n:], mask[i, width - n:] = seqs[i][:n], 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)
