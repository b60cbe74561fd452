"""Exact speculative sampling (miles/rollout/speculative.py) on toy first-order Markov models.

The target and the draft are random tables of next-token logits indexed by the last token (4 tokens and
a BOS row). Sequences of 3 tokens are generated speculatively, k = 3 drafts per round, and their
empirical joint distribution is compared with the target's exact one, p(x1 | BOS) p(x2 | x1) p(x3 | x2),
by a chi-square test (chi_square.py: the threshold at the 1 - 1e-4 quantile, rare cells pooled).
40,000 sequences are drawn. Cells the target cannot reach (top-k, top-p) must stay empty. As a negative
control, the same test applied to the draft's own samples (every draft kept) must fail.
"""

import pytest
import torch
from chi_square import chi_square_counts

from miles.rollout.sampling import sampling_probs
from miles.rollout.speculative import verify_draft

V, LENGTH, K, N = 4, 3, 3, 40_000


def tables(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(V + 1, V, generator=gen) * 1.5, torch.randn(V + 1, V, generator=gen) * 1.5


def speculative_sequences(target, draft, temperature, top_p, top_k, seed, keep_all=False) -> torch.Tensor:
    """[N, LENGTH] sequences from rounds of K drafts verified against the target (keep_all: every
    draft kept, i.e. the draft's own samples)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [[] for _ in range(N)]
    last = torch.full((N,), V)  # BOS
    while True:
        rows = torch.tensor([i for i, s in enumerate(seqs) if len(s) < LENGTH])
        if len(rows) == 0:
            return torch.tensor(seqs)
        cur, tokens, probs = last[rows], [], []
        for _ in range(K):
            q, _ = sampling_probs(draft[cur], temperature, top_p, top_k)
            cur = torch.multinomial(q, 1, generator=gen).squeeze(-1)
            tokens.append(cur)
            probs.append(q)
        draft_tokens, draft_probs = torch.stack(tokens, 1), torch.stack(probs, 1)
        contexts = torch.cat([last[rows, None], draft_tokens], 1)  # the last token before each position
        if keep_all:
            emitted, count = draft_tokens, torch.full((len(rows),), K)
        else:
            emitted, count, _ = verify_draft(target[contexts], draft_probs, draft_tokens, temperature, top_p,
                                             top_k, generator=gen)
        for r, row in enumerate(rows.tolist()):
            seqs[row].extend(emitted[r, :count[r]].tolist())
            del seqs[row][LENGTH:]
            last[row] = seqs[row][-1]


def exact_joint(target, temperature, top_p, top_k) -> torch.Tensor:
    """[V, V, V] probabilities of the target's 3-token sequences."""
    p = sampling_probs(target, temperature, top_p, top_k)[0].double()  # [V + 1, V]: next token | last
    return torch.einsum("a,ab,bc->abc", p[V], p[:V], p[:V])


def chi_square(seqs: torch.Tensor, joint: torch.Tensor) -> tuple[float, float, int]:
    """(statistic, threshold, samples in cells the target cannot reach)."""
    cells = (seqs[:, 0] * V + seqs[:, 1]) * V + seqs[:, 2]
    counts = torch.bincount(cells, minlength=V ** 3)
    exact = {cell: p for cell, p in enumerate(joint.flatten().tolist()) if p > 0}
    stat, threshold = chi_square_counts(dict(enumerate(counts.tolist())), exact, len(seqs))
    return stat, threshold, int(sum(n for cell, n in enumerate(counts.tolist()) if cell not in exact))


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 1.0, 3), (1.3, 0.9, 0)])
def test_speculative_samples_follow_the_target_distribution(temperature, top_p, top_k):
    target, draft = tables(0)
    joint = exact_joint(target, temperature, top_p, top_k)
    stat, threshold, impossible = chi_square(speculative_sequences(target, draft, temperature, top_p, top_k, 1),
                                             joint)
    assert impossible == 0
    assert stat < threshold, (stat, threshold)
    # The negative control: the draft's own samples are told apart from the target's.
    control, _, _ = chi_square(speculative_sequences(target, draft, temperature, top_p, top_k, 1, keep_all=True),
                               joint.clamp(min=1e-12))
    assert control > 10 * threshold, control


def test_a_draft_equal_to_the_target_is_always_kept():
    target, _ = tables(0)
    gen = torch.Generator().manual_seed(0)
    cur, drafts, probs = torch.randint(0, V + 1, (64,), generator=gen), [], []
    contexts = [cur]
    for _ in range(K):  # the target drafting for itself
        q, _ = sampling_probs(target[cur], 1.0)
        cur = torch.multinomial(q, 1, generator=gen).squeeze(-1)
        drafts.append(cur)
        probs.append(q)
        contexts.append(cur)
    drafts, contexts = torch.stack(drafts, 1), torch.stack(contexts, 1)
    tokens, count, logp = verify_draft(target[contexts], torch.stack(probs, 1), drafts, 1.0, generator=gen)
    assert torch.equal(count, torch.full((64,), K + 1)) and torch.equal(tokens[:, :K], drafts)
    full = torch.log_softmax(target[contexts], -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(logp, full)


def test_greedy_output_equals_plain_greedy_decoding():
    target, draft = tables(3)
    gen = torch.Generator().manual_seed(0)
    plain = [V]
    for _ in range(8):
        plain.append(int(target[plain[-1]].argmax()))
    out = [V]
    while len(out) < 9:
        drafts, cur = [], out[-1]
        for _ in range(K):
            cur = int(torch.multinomial(torch.softmax(draft[cur], -1), 1, generator=gen))  # any draft
            drafts.append(cur)
        contexts = torch.tensor([[out[-1], *drafts]])
        tokens, count, logp = verify_draft(target[contexts], torch.zeros(1, K, V), torch.tensor([drafts]), 0.0)
        emitted = tokens[0, :count[0]].tolist()
        assert tokens[0, count[0]:].eq(-1).all() and logp[0, count[0]:].eq(0).all()
        expected_logp = torch.log_softmax(target[contexts[0, :count[0]]], -1)[torch.arange(count[0]), emitted]
        torch.testing.assert_close(logp[0, :count[0]], expected_logp)
        out.extend(emitted)
    assert out[:9] == plain
