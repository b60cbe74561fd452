"""Token sampling from next-token logits: temperature, top-k, top-p; greedy when temperature is 0.

The returned log-prob is that of the sampled token under softmax(logits / temperature), before the
top-k / top-p truncation: the trainer recomputes exactly that quantity, so the two are comparable.
"""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] logits -> (token ids [B], log-probs [B]).

    Sampling is the exponential race token = argmax(p / noise) with noise ~ Exp(1) [B, V], which is
    how torch.multinomial draws one sample (same draws from the same generator). `noise` lets the
    caller supply the draws, e.g. drawn for a larger batch and indexed; else they come from `generator`.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    probs, logp = sampling_probs(logits, temperature, top_p, top_k)
    if noise is None:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    tokens = (probs / noise).argmax(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] logits, temperature > 0 -> (the distribution sample_next draws from, after top-k /
    top-p; log softmax(logits / temperature) before them, what the log-probs report)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1)
    filtered = logp
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(filtered, top_k, dim=-1).values[..., -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(filtered, dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p (the top token always stays).
        mass_before = torch.cumsum(sorted_lp.exp(), -1) - sorted_lp.exp()
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    return torch.softmax(filtered, -1), logp
