"""Speculative decoding in the native engine: a draft proposes k tokens per row, the target verifies
them in one forward, and exact rejection sampling (miles/rollout/speculative.py) keeps a prefix of
them plus one token of its own. The output is distributed as plain sampling from the target, greedy
output is plain greedy decoding, and every emitted token carries the target's log-prob.

    decoder = SpeculativeDecoder(model, MTPDraft(model), k=3, pad_id=0, stop_ids=stops)
    rows = decoder.generate(prompt_ids, n, Sampling(1.0, 1.0, 0, 64), generator)
    # per sample: (response ids, log-probs, ended on a stop token, verify steps, drafts accepted)

Drafts: `MTPDraft` chains the model's own MTP module (depth 0) k times from the target's hidden
states (miles/models/mtp.py); `ModelDraft` decodes a small separate model with its own cache.

Cache layout. Prompts are left-padded and prefilled once per distinct prompt, as on the padded path.
Each verify step writes k + 1 cache columns for every row, whatever it accepts: the columns of
rejected draft tokens get attention-mask 0 (holes that no later query attends to) and each row keeps
its own next position, so rows that accept different counts stay in one batch without any cache
copy. A cache therefore holds up to k + 1 columns per emitted token. Linear-attention layers
(Qwen3-Next), whose state has no columns, keep the state after every verified token and rewind to
the one after the last accepted token (DeltaNetCache.rewind).

Per-group generators (`generators`, the engine's seeds): every random draw of a group (the first
token, each draft token, each verification) comes from its own generator and only for its rows
still decoding, so a group's samples do not depend on the other prompts of the batch.

Several LoRA adapters (`route`: the engine's `LoRA.route`, with generate's `adapters`, one id per
prompt): the prefill routes per prompt, then every round routes each batch row by its sample's
adapter (`rows`, compacted with the batch) before the draft's forwards and the verify forward. The
MTP draft reads the target's hidden states, computed under each row's own adapter (its own modules,
like a separate draft model, hold no adapters).
"""

from __future__ import annotations

import torch

from miles.models.cache import ModelCache
from miles.rollout.sampling import sampling_probs
from miles.rollout.slots import Sampling
from miles.rollout.speculative import verify_draft

# Finished rows leave the batch once they are this fraction of it (as on the padded path).
COMPACT_AT = 0.25


class Picker:
    """Draws one token per row from next-token logits, greedy at temperature 0; returns the tokens and
    the distribution they were drawn from (None when greedy: verification then ignores it)."""

    def __init__(self, sampling: Sampling, generator: torch.Generator, generators: list | None, n: int):
        self.s, self.generator, self.generators, self.n = sampling, generator, generators, n
        self.rows: torch.Tensor | None = None  # the sample index of each batch row (set by the decoder)
        self.live: torch.Tensor | None = None  # which batch rows still decode (None: all; set by the decoder)

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.s.temperature == 0:
            return logits.float().argmax(-1), None
        probs = sampling_probs(logits, self.s.temperature, self.s.top_p, self.s.top_k)[0]
        return self.each_group(lambda p, g: torch.multinomial(p, 1, generator=g).squeeze(-1), probs), probs

    def each_group(self, draw, *tensors: torch.Tensor):
        """draw(*tensors, generator) on all rows, or group by group with each group's own generator,
        for its live rows only: how many finished rows ride along (the batch's business) then changes
        no draw of the group (rows left out get zeros)."""
        if self.generators is None:
            return draw(*tensors, self.generator)
        groups = self.rows // self.n
        live = self.live if self.live is not None and bool(self.live.any()) else \
            torch.ones_like(groups, dtype=torch.bool)
        out = None
        for g in groups[live].unique().tolist():
            at = ((groups == g) & live).nonzero().squeeze(1)
            part = draw(*(t[at] for t in tensors), self.generators[g])
            parts = part if isinstance(part, tuple) else (part,)
            if out is None:
                out = [p.new_zeros((len(groups), *p.shape[1:])) for p in parts]
            for o, p in zip(out, parts):
                o[at] = p
        return tuple(out) if isinstance(part, tuple) else out[0]


def draft_chain(pick: Picker, logits: torch.Tensor, k: int, step) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k draft tokens [B, k] and the distributions they came from [B, k, V] (None when greedy): each
    token is drawn from `logits`, then `step(j, token)` runs the draft on it and gives the next logits."""
    tokens, probs = [], []
    for j in range(k):
        token, q = pick(logits)
        tokens.append(token)
        probs.append(q)
        if j < k - 1:
            logits = step(j, token)
    return torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1)


class ModelDraft:
    """A small separate model (same tokenizer) as the draft: k single-token decode steps on its own
    cache. A row that accepted all k drafts has the last one not yet in that cache: the next round
    feeds it first (`carry`), in the same forward as the pending token."""

    def __init__(self, model):
        self.model = model

    def prefill(self, tokens, mask, positions, hidden, columns: int, expand: torch.Tensor, first, pos) -> None:
        self.cache = self.model.new_cache(tokens.shape[0], columns)
        self.model(tokens, attention_mask=mask, position_ids=positions, cache=self.cache)
        self.cache = _select(self.cache, expand)
        self.mask = mask[expand]
        self.carry = torch.zeros_like(first)
        self.carry_valid = torch.zeros_like(first, dtype=torch.bool)

    def propose(self, pending: torch.Tensor, pos: torch.Tensor, k: int, pick: Picker):
        # Always two columns (no host sync to ask whether any row carries): the carry's is masked off
        # where the row has none.
        inputs = torch.stack([self.carry, pending], 1)
        valid = torch.stack([self.carry_valid, torch.ones_like(self.carry_valid)], 1)
        positions = torch.stack([pos - 1, pos], 1)
        self.mask = torch.cat([self.mask, valid.to(self.mask.dtype)], 1)
        logits = self.model(inputs, attention_mask=self.mask, position_ids=positions, cache=self.cache)[:, -1]
        self.round_start = self.mask.shape[1]  # the columns of draft tokens 1..k-1 start here

        def step(j, token):
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(pos), 1)], 1)
            return self.model(token[:, None], attention_mask=self.mask, position_ids=(pos + j + 1)[:, None],
                              cache=self.cache)[:, -1]

        self.drafted, probs = draft_chain(pick, logits, k, step)
        return self.drafted, probs

    def commit(self, count: torch.Tensor, emitted, hidden, pos) -> None:
        accepted = count - 1
        k = self.drafted.shape[1]
        if k > 1:  # draft token j (1..k-1) stays visible iff it was accepted
            j = torch.arange(1, k, device=count.device)
            self.mask[:, self.round_start:] = (j[None] <= accepted[:, None]).to(self.mask.dtype)
        self.carry, self.carry_valid = self.drafted[:, -1], accepted == k

    def select(self, keep: torch.Tensor) -> None:
        self.cache = _select(self.cache, keep)
        self.mask, self.carry, self.carry_valid = self.mask[keep], self.carry[keep], self.carry_valid[keep]
        self.drafted = self.drafted[keep]


class MTPDraft:
    """The target's MTP module (depth 0) as the draft. The pair (h_t, x_{t+1}) of the target's hidden
    state at position t and the token after it predicts x_{t+2}. Each round forwards the pairs of the
    tokens verified last round (`pend`, the target's own hidden states, so they are the module's real
    inputs and stay in its cache), then chains the module on its own output for the other k - 1 draft
    tokens; those chained pairs are guesses, masked out once verification is done."""

    def __init__(self, model):
        if model.mtp is None:
            raise ValueError("rollout.speculative.kind=mtp needs MTP modules: set model.mtp_layers=1")
        self.model = model

    def prefill(self, tokens, mask, positions, hidden, columns: int, expand: torch.Tensor, first, pos) -> None:
        rows, width = tokens.shape
        self.cache = self.model.new_mtp_cache(rows, columns)
        self.mask = mask[:, :-1]  # the pair at column c is real iff column c is (then c + 1 is too)
        if width > 1:
            self.model.mtp_forward(hidden[:, :-1], tokens[:, 1:], attention_mask=self.mask,
                                   position_ids=positions[:, :-1], cache=self.cache)
        self.cache = _select(self.cache, expand)
        self.mask = self.mask[expand]
        self.pend_h, self.pend_tok = hidden[expand, -1:], first[:, None]
        self.pend_valid = torch.ones_like(self.pend_tok, dtype=torch.bool)
        self.pend_pos = (pos - 1)[:, None]

    def propose(self, pending: torch.Tensor, pos: torch.Tensor, k: int, pick: Picker):
        model, rows = self.model, torch.arange(len(pos), device=pos.device)
        self.mask = torch.cat([self.mask, self.pend_valid.to(self.mask.dtype)], 1)
        out = model.mtp_forward(self.pend_h, self.pend_tok, attention_mask=self.mask, position_ids=self.pend_pos,
                                cache=self.cache, return_hidden=True)
        h = out[rows, self.pend_valid.sum(1) - 1]  # the last real pair: it predicts the token after `pending`
        self.round_start = self.mask.shape[1]
        last = [h]  # the chain's hidden state: the module's own output feeds its next step

        def step(j, token):
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(pos), 1)], 1)
            last[0] = model.mtp_forward(last[0][:, None], token[:, None], attention_mask=self.mask,
                                        position_ids=(pos + j)[:, None], cache=self.cache, return_hidden=True)[:, 0]
            return model.logits_from_hidden(last[0])

        return draft_chain(pick, model.logits_from_hidden(h), k, step)

    def commit(self, count: torch.Tensor, emitted, hidden, pos) -> None:
        self.mask[:, self.round_start:] = 0
        j = torch.arange(emitted.shape[1], device=count.device)
        self.pend_h, self.pend_tok = hidden, emitted.clamp(min=0)
        self.pend_valid, self.pend_pos = j[None] < count[:, None], pos[:, None] + j[None]

    def select(self, keep: torch.Tensor) -> None:
        self.cache = _select(self.cache, keep)
        self.mask, self.pend_h, self.pend_tok = self.mask[keep], self.pend_h[keep], self.pend_tok[keep]
        self.pend_valid, self.pend_pos = self.pend_valid[keep], self.pend_pos[keep]


class Outputs:
    """What a speculative generate call returns, kept on the device: every sample's tokens and
    log-probs, its length, whether it stopped, its verify steps and accepted drafts. `emit` applies
    one verify step without a host sync (rows index the samples of the batch rows)."""

    def __init__(self, samples: int, max_new: int, k: int, pad_id: int, stop_ids: torch.Tensor, device):
        self.max_new, self.stop_ids = max_new, stop_ids
        self.tokens = torch.full((samples, max_new + k + 1), pad_id, dtype=torch.long, device=device)
        self.logp = torch.zeros(samples, max_new + k + 1, device=device)
        self.length = torch.zeros(samples, dtype=torch.long, device=device)
        self.stopped = torch.zeros(samples, dtype=torch.bool, device=device)
        self.steps = torch.zeros(samples, dtype=torch.long, device=device)
        self.accepted = torch.zeros(samples, dtype=torch.long, device=device)
        self.span = torch.arange(k + 1, device=device)

    def first(self, token: torch.Tensor, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """The token sampled from the prefill (rows = samples); returns which rows decode on."""
        logp = torch.log_softmax(logits.float() / (temperature or 1.0), -1).gather(-1, token[:, None]).squeeze(-1)
        self.tokens[:, 0], self.logp[:, 0], self.length[:] = token, logp, 1
        self.stopped = torch.isin(token, self.stop_ids)
        return ~self.stopped & (self.length < self.max_new)

    def emit(self, rows: torch.Tensor, live: torch.Tensor, emitted: torch.Tensor, count: torch.Tensor,
             logp: torch.Tensor) -> torch.Tensor:
        """Keep each live row's verified tokens up to its first stop token, within max_new; returns
        the rows still live."""
        span, length = self.span, self.length[rows]
        room = self.max_new - length
        is_stop = torch.isin(emitted, self.stop_ids) & (span[None] < count[:, None])
        first_stop = torch.where(is_stop.any(1), is_stop.float().argmax(1), self.max_new)  # max_new: none
        keep = torch.minimum(torch.minimum(count, first_stop + 1), room) * live
        cols = (length[:, None] + span[None]).clamp(max=self.tokens.shape[1] - 1)
        write = span[None] < keep[:, None]
        at = rows[:, None].expand_as(cols)
        self.tokens[at, cols] = torch.where(write, emitted, self.tokens[at, cols])
        self.logp[at, cols] = torch.where(write, logp, self.logp[at, cols])
        stopped = live & (first_stop < room)
        self.steps.index_add_(0, rows, live.long())
        self.accepted.index_add_(0, rows, (count - 1) * live)
        self.length.index_add_(0, rows, keep)
        self.stopped[rows] |= stopped
        return live & ~stopped & (self.length[rows] < self.max_new)

    def results(self) -> list[tuple[list[int], list[float], bool, int, int]]:
        tokens, logp, length = self.tokens.cpu().tolist(), self.logp.cpu().tolist(), self.length.tolist()
        stopped, steps, accepted = self.stopped.tolist(), self.steps.tolist(), self.accepted.tolist()
        return [(tokens[i][:length[i]], logp[i][:length[i]], stopped[i], steps[i], accepted[i])
                for i in range(len(length))]


def verify(logits, draft_probs, drafted, sampling: Sampling, pick: Picker):
    """verify_draft over the batch, or per group from each group's generator."""
    if sampling.temperature == 0:
        return verify_draft(logits, None, drafted, 0.0)
    return pick.each_group(lambda lg, q, d, g: verify_draft(lg, q, d, sampling.temperature, sampling.top_p,
                                                             sampling.top_k, generator=g),
                           logits, draft_probs, drafted)


def check_interval(k: int, sync_every: int) -> int:
    """Verify steps between two host checks (finished rows, the end of the call): rollout.sync_every
    counts decode steps, and a verify step emits up to k + 1 tokens."""
    return max(1, sync_every // (k + 1))


class SpeculativeDecoder:
    def __init__(self, model, draft, k: int, pad_id: int, stop_ids: torch.Tensor, compact_at: float = COMPACT_AT,
                 sync_every: int = 1, route=None):
        if k < 1:
            raise ValueError(f"rollout.speculative.num_tokens must be >= 1, got {k}")
        self.model, self.draft, self.k, self.pad_id, self.stop_ids = model, draft, k, pad_id, stop_ids
        self.compact_at, self.check_every = compact_at, check_interval(k, sync_every)
        self.route = route  # several LoRA adapters: the engine's LoRA.route

    @torch.no_grad()
    def generate(self, distinct: list[list[int]], n: int, sampling: Sampling, generator: torch.Generator,
                 generators: list | None = None,
                 adapters: list[int] | None = None) -> list[tuple[list[int], list[float], bool, int, int]]:
        """(response ids, log-probs, ended on a stop token, verify steps, drafts accepted) per sample,
        row i*n+j answering distinct[i]; `generators`: one per prompt (seeds), else `generator`;
        `adapters`: one LoRA adapter id per prompt, exactly when the decoder routes (`route`)."""
        model, k = self.model, self.k
        device = model.device
        if (adapters is None) != (self.route is None):
            raise ValueError("adapters: one LoRA adapter id per prompt exactly when the decoder routes by them")
        sample_adapters = None
        if adapters is not None:  # the prefills (target's and MTP draft's) per prompt, then per batch row
            prompt_adapters = torch.tensor(adapters, dtype=torch.long, device=device)
            self.route(prompt_adapters[:, None])
            sample_adapters = prompt_adapters.repeat_interleave(n)
        prompts, width = len(distinct), max(len(p) for p in distinct)
        tokens = torch.full((prompts, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(prompts, width, dtype=torch.long)
        for i, ids in enumerate(distinct):
            tokens[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        tokens, mask = tokens.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        rounds = max(sampling.max_new - 1, 0)  # verify steps at most: each emits at least one token
        cache = model.new_cache(prompts, width + rounds * (k + 1))
        hidden = model(tokens, attention_mask=mask, position_ids=positions, cache=cache, return_hidden=True)
        expand = torch.arange(prompts, device=device).repeat_interleave(n)
        cache = _select(cache, expand)
        prompt_mask, mask, pos = mask, mask[expand], positions[expand, -1] + 1

        pick = Picker(sampling, generator, generators, n)
        rows = pick.rows = torch.arange(prompts * n, device=device)  # batch row -> sample
        logits = model.logits_from_hidden(hidden[:, -1])[expand]
        pending, _ = pick(logits)
        out = Outputs(prompts * n, sampling.max_new, k, self.pad_id, self.stop_ids, device)
        live = out.first(pending, logits, sampling.temperature)
        # The draft's cache: the prompt, then at most 2k columns per round (MTPDraft's pairs and chain).
        self.draft.prefill(tokens, prompt_mask, positions, hidden, width + rounds * 2 * k, expand, pending, pos)
        span = out.span
        for round_ in range(rounds):
            if round_ % self.check_every == 0:  # the one host sync: done? rows to drop?
                n_live = int(live.sum())
                if n_live == 0:
                    break
                if len(rows) - n_live >= self.compact_at * len(rows):
                    keep = live.nonzero().squeeze(1)
                    cache = _select(cache, keep)
                    self.draft.select(keep)
                    rows, live, mask, pos, pending = rows[keep], live[keep], mask[keep], pos[keep], pending[keep]
                    pick.rows = rows
            pick.live = live
            if sample_adapters is not None:  # each row's own adapter, for the draft's and the verify forwards
                self.route(sample_adapters[rows, None])
            drafted, draft_probs = self.draft.propose(pending, pos, k, pick)
            cache.track_steps(True)
            mask = torch.cat([mask, mask.new_ones(len(rows), k + 1)], 1)
            hidden = model(torch.cat([pending[:, None], drafted], 1), attention_mask=mask,
                           position_ids=pos[:, None] + span, cache=cache, return_hidden=True)
            emitted, count, logp = verify(model.logits_from_hidden(hidden), draft_probs, drafted, sampling, pick)
            cache.rewind(count)  # linear attention: the state after the pending token and the accepted drafts
            cache.track_steps(False)
            mask[:, -k:] = (span[None, 1:] < count[:, None]).to(mask.dtype)
            self.draft.commit(count, emitted, hidden, pos)
            live = out.emit(rows, live, emitted, count, logp)
            pending = emitted[torch.arange(len(rows), device=device), count - 1]
            pos = pos + count
        return out.results()


def _select(cache: ModelCache, index: torch.Tensor) -> ModelCache:
    selected = cache.select(index)
    return cache if selected is None else selected
