"""Speculative decoding with a draft model over static slot caches, its forwards replayed from CUDA graphs.

The GPU path of `rollout.speculative.kind=draft_model` when the target and the draft are GQA or MLA
models (`CausalLM.supports_slot_decode`); miles/rollout/spec_decode.py is the general path and describes
the algorithm. Here every row of the target's and of the draft's `SlotCache` has its own length, so a
rejected draft leaves no hole: the length advances by what the row accepted and the next round
overwrites the columns after it. The shapes of every forward are then fixed for a given number of
rows, and each is captured once per bucket (miles/rollout/slots.py's bucket sizes):

- the verify forward, b rows x (k + 1) tokens (the pending token and the k drafts), logits at all;
- the draft's first step, b rows x 2 tokens: the token before the pending one (rewritten where it is
  already cached, written where the row accepted every draft of the last round) and the pending one;
- the draft's next steps, b rows x 1 token.

Sampling and verification run eagerly between the replays. A generate call admits whole prompt groups
up to the slot count, prefills each distinct prompt once (right-padded) into its n slots for both
models, and decodes until every row is done; finished rows ride along until enough of them have
finished to move the live ones into a smaller bucket.

Several LoRA adapters (`route`: the engine's `LoRA.route`): each slot's adapter id lives in a
persistent buffer that the verify forward routes by (a view of it, so a captured graph reads the
slots' current adapters); the prefill routes per prompt, and compaction moves the ids with the rows.
The draft model holds no adapters.
"""

from __future__ import annotations

import torch

from miles.models.cache import SlotCache
from miles.rollout.slots import Sampling, _warmup_stream, default_buckets
from miles.rollout.spec_decode import COMPACT_AT, Outputs, Picker, check_interval, draft_chain, verify


class BucketGraphs:
    """`fn(b)` for each bucket b, captured once (largest first, one memory pool) when `capture`;
    fn reads and writes only buffers that outlive it, so replays see their current contents."""

    def __init__(self, fn, buckets: list[int], capture: bool):
        self.fn, self.buckets = fn, buckets
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            stream = _warmup_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for b in buckets:
                    fn(b)
            torch.cuda.current_stream().wait_stream(stream)
            pool = None
            for b in sorted(buckets, reverse=True):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[b] = fn(b)
                pool = graph.pool()
                self.graphs[b] = graph

    def run(self, b: int) -> torch.Tensor:
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b]
        return self.fn(b)


class SlotSpeculativeDecoder:
    def __init__(self, model, draft, k: int, slots: int, max_len: int, pad_id: int, stop_ids: torch.Tensor,
                 cuda_graphs: bool, compact_at: float = COMPACT_AT, sync_every: int = 1, route=None):
        self.route = route  # several LoRA adapters: the engine's LoRA.route
        self.model, self.draft, self.k, self.slots, self.max_len = model, draft, k, slots, max_len
        self.pad_id, self.stop_ids, self.compact_at = pad_id, stop_ids, compact_at
        self.check_every = check_interval(k, sync_every)
        self.device = model.device
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        # A call decodes a static batch: smaller buckets serve only the tail, powers of two suffice
        # (each bucket captures three graphs).
        self.buckets = sorted({b for b in default_buckets(slots) if b & (b - 1) == 0} | {slots})
        self.state = None  # allocated (and captured) at the first generate call after a release

    # ----------------------------------------------------------------------------- memory
    def release(self) -> None:
        """Drop both slot caches and the captured graphs (colocation); the next call rebuilds them."""
        self.state = None

    def nbytes(self) -> int:
        if self.state is None:
            return 0
        return self.state["target"].nbytes() + self.state["draft"].nbytes()

    def _allocate(self) -> dict:
        s, k, dev, dtype = self.slots, self.k, self.device, self.model.dtype
        target = SlotCache([l.attn.new_cache(s, self.max_len, dtype, dev) for l in self.model.layers], self.max_len, s)
        draft = SlotCache([l.attn.new_cache(s, self.max_len, dtype, dev) for l in self.draft.layers], self.max_len, s)
        st = {"target": target, "draft": draft,
              "verify_ids": torch.full((s, k + 1), self.pad_id, dtype=torch.long, device=dev),
              "verify_pos": torch.zeros(s, k + 1, dtype=torch.long, device=dev),
              "first_ids": torch.full((s, 2), self.pad_id, dtype=torch.long, device=dev),
              "first_pos": torch.zeros(s, 2, dtype=torch.long, device=dev),
              "next_ids": torch.full((s, 1), self.pad_id, dtype=torch.long, device=dev),
              "next_pos": torch.zeros(s, 1, dtype=torch.long, device=dev),
              "adapters": torch.zeros(s, dtype=torch.long, device=dev)}  # each slot's LoRA adapter (route)
        views = {b: (target.first_rows(b), draft.first_rows(b)) for b in self.buckets}

        def verify(b):
            if self.route is not None:  # a view of the persistent buffer: what a captured graph reads
                self.route(st["adapters"][:b, None])
            hidden = self.model(st["verify_ids"][:b], position_ids=st["verify_pos"][:b], cache=views[b][0],
                                return_hidden=True)
            return self.model.logits_from_hidden(hidden)

        def draft_first(b):
            return self.draft(st["first_ids"][:b], position_ids=st["first_pos"][:b], cache=views[b][1])[:, -1]

        def draft_next(b):
            return self.draft(st["next_ids"][:b], position_ids=st["next_pos"][:b], cache=views[b][1])[:, 0]

        with torch.no_grad():
            st["graphs"] = {name: BucketGraphs(fn, self.buckets, self.cuda_graphs)
                            for name, fn in (("verify", verify), ("first", draft_first), ("next", draft_next))}
        # Warm-up and capture wrote into empty slots at column 0: the caches start over anyway.
        return st

    # ----------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def generate(self, distinct: list[list[int]], n: int, sampling: Sampling, generator: torch.Generator,
                 generators: list | None = None,
                 adapters: list[int] | None = None) -> list[tuple[list[int], list[float], bool, int, int]]:
        """As SpeculativeDecoder.generate: (response, log-probs, stopped, verify steps, drafts accepted)."""
        if (adapters is None) != (self.route is None):
            raise ValueError("adapters: one LoRA adapter id per prompt exactly when the decoder routes by them")
        if n > self.slots:
            raise ValueError(f"n_samples_per_prompt ({n}) exceeds the engine's {self.slots} slots")
        width = max(len(p) for p in distinct)
        if width + sampling.max_new + self.k + 1 > self.max_len:
            raise ValueError(f"prompt ({width} tokens) + max_new_tokens ({sampling.max_new}) + "
                             f"num_tokens + 1 exceeds the engine's {self.max_len} cache columns; "
                             "raise rollout.max_prompt_len")
        if self.state is None:
            self.state = self._allocate()
        per_chunk = self.slots // n
        results = []
        for start in range(0, len(distinct), per_chunk):
            groups = distinct[start:start + per_chunk]
            chunk_gens = None if generators is None else generators[start:start + per_chunk]
            chunk_adapters = None if adapters is None else adapters[start:start + per_chunk]
            results += self._chunk(groups, n, sampling, generator, chunk_gens, chunk_adapters)
        return results

    def _prefill(self, model, cache: SlotCache, tokens, lengths, src) -> torch.Tensor:
        """Right-padded prompts -> their KV in slots [0, len(src)) and the hidden state of each last token."""
        prefill = model.new_cache(tokens.shape[0], tokens.shape[1], dtype=cache.dtype,
                                  device=self.device)
        hidden = model(tokens, cache=prefill, return_hidden=True)
        rows = torch.arange(len(src), device=self.device)
        cache.load_prefill(rows, prefill, src, tokens.shape[1])
        return hidden[torch.arange(tokens.shape[0], device=self.device), lengths - 1]

    def _chunk(self, groups: list[list[int]], n: int, sampling: Sampling, generator, generators, adapters=None):
        st, k, dev, max_new = self.state, self.k, self.device, sampling.max_new
        target, draft, graphs = st["target"], st["draft"], st["graphs"]
        width, batch = max(len(p) for p in groups), len(groups) * n
        tokens = torch.full((len(groups), width), self.pad_id, dtype=torch.long)
        for i, ids in enumerate(groups):
            tokens[i, :len(ids)] = torch.tensor(ids)
        lengths = torch.tensor([len(ids) for ids in groups], device=dev)
        tokens, src = tokens.to(dev), torch.arange(len(groups), device=dev).repeat_interleave(n)
        if adapters is not None:  # the prefill per prompt, the verify forwards per slot (the buffer)
            prompt_adapters = torch.tensor(adapters, dtype=torch.long, device=dev)
            self.route(prompt_adapters[:, None])
            st["adapters"][:batch] = prompt_adapters[src]
        last = self._prefill(self.model, target, tokens, lengths, src)
        self._prefill(self.draft, draft, tokens, lengths, src)
        pos = lengths[src]  # each row's pending token goes to this position (= its committed length)
        prev = tokens[src, pos - 1]  # the token before the pending one (the draft's first input)

        pick = Picker(sampling, generator, generators, n)
        rows = pick.rows = torch.arange(batch, device=dev)
        logits = self.model.logits_from_hidden(last)[src]
        pending, _ = pick(logits)
        out = Outputs(batch, max_new, k, self.pad_id, self.stop_ids, dev)
        live = out.first(pending, logits, sampling.temperature)
        span = out.span
        b = next(x for x in self.buckets if x >= batch)
        for round_ in range(max(max_new - 1, 0)):
            if round_ % self.check_every == 0:  # the one host sync: done? rows to move down?
                n_live = int(live.sum())
                if n_live == 0:
                    break
                smaller = next(x for x in self.buckets if x >= n_live)
                if smaller < b and len(rows) - n_live >= self.compact_at * len(rows):
                    keep = live.nonzero().squeeze(1)
                    dst = torch.arange(len(keep), device=dev)
                    target.move_rows(dst, keep)
                    draft.move_rows(dst, keep)
                    st["adapters"][:len(keep)] = st["adapters"][keep].clone()
                    rows, live, pos, prev, pending = rows[keep], live[keep], pos[keep], prev[keep], pending[keep]
                    pick.rows, b = rows, smaller
            n_rows, pick.live = len(rows), live
            # Draft: the token before the pending one and the pending one, then k - 1 single steps.
            draft.lengths[:n_rows] = pos - 1
            st["first_ids"][:n_rows] = torch.stack([prev, pending], 1)
            st["first_pos"][:n_rows] = torch.stack([pos - 1, pos], 1)

            def step(j, token):
                draft.lengths[:n_rows] = pos + j + 1
                st["next_ids"][:n_rows, 0], st["next_pos"][:n_rows, 0] = token, pos + j + 1
                return graphs["next"].run(b)[:n_rows]

            drafted, draft_probs = draft_chain(pick, graphs["first"].run(b)[:n_rows], k, step)
            # Verify: the pending token and the drafts at the row's own columns.
            target.lengths[:n_rows] = pos
            st["verify_ids"][:n_rows] = torch.cat([pending[:, None], drafted], 1)
            st["verify_pos"][:n_rows] = pos[:, None] + span
            logits = graphs["verify"].run(b)[:n_rows]
            emitted, count, logp = verify(logits, draft_probs, drafted, sampling, pick)
            advance = count * live  # finished rows keep their position (their writes stay in their own slot)
            live = out.emit(rows, live, emitted, count, logp)
            index = torch.arange(n_rows, device=dev)
            prev = torch.where(advance >= 2, emitted[index, (count - 2).clamp(min=0)],
                               torch.where(advance > 0, pending, prev))
            pending = torch.where(advance > 0, emitted[index, count - 1], pending)
            pos = pos + advance
        return out.results()
