"""Continuous batching over a static slot cache, the decode step replayed from CUDA graphs.

The GPU path of `NativeEngine` (GQA, MLA and DSA families; MLA slots hold the latent + rope key and
decode in the weight-absorbed form, miles/models/mla_decode.py). A fixed number of slots (rows of a `SlotCache`,
allocated once; colocation frees and reallocates them with `release` / `allocate`, and captures
the graphs again) hold the samples being decoded, each at its own length:

- admission: whole prompt groups enter as soon as n slots are free (the lowest free ones); each
  distinct prompt is prefilled once (right-padded, causal, no mask) and its cache rows copied to its n slots;
- decode: one step for the rows [0, bucket) with bucket the smallest captured batch size that
  covers every slot in use; the forward is a CUDA-graph replay (`DecodeGraphs`), sampling and the
  bookkeeping are a few device kernels, with no host synchronisation inside `sync_every` steps;
- every `sync_every` steps the host reads which slots finished, collects their responses, refills
  freed slots with waiting groups, and in the tail (nothing waiting) moves the last live rows down
  so a smaller graph covers them.

Finished rows ride along until the next check; they write only into their own slot (at a frozen
column) and their tokens are masked, so they change nothing. The model is the trainer's own
`CausalLM`: a captured step runs exactly `CausalLM.forward` in slot-decode mode.

Per-group seeds (`generators`, one per prompt): a group draws one [n, vocab] block of sampling
noise from its own generator at admission and at every step while any of its slots is held, so the
t-th draw of a group always feeds token t of its samples, whichever slots, bucket or neighbours they
have. The draws per step are one small kernel per group held, planned at each host check.

Several LoRA adapters (`route`: the engine's `LoRA.route`): each slot's adapter lives in a persistent
buffer (`adapters`, set at admission, moved with the slot by compaction) that the decode forward
routes by, so a captured graph reads the slots' current adapters at every replay.

Routing record (R3, `routing` given; MoE models): the prefill's experts of each prompt's real
tokens, and per slot a [max_new, L, k] buffer where each step writes the experts of its input token
(response token steps - 1) at column steps - 1. Finished rows keep writing at their frozen column,
that of their last token, which has no routing (miles/types.py). A captured step records too: each
bucket's graph is captured with a record dict whose tensors (the routers' top-k outputs) are static
outputs of the graph, as its logits are; every replay rewrites them and the step copies them out.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from miles.models.cache import SlotCache
from miles.rollout.memory import KV_CACHE
from miles.rollout.pausable import PausableMemory
from miles.rollout.sampling import sample_next
from miles.types import stack_routing


def default_buckets(slots: int) -> list[int]:
    """Captured batch sizes: powers of two and their 1.5x midpoints up to `slots`, and `slots`."""
    sizes, b = {slots}, 1
    while b < slots:
        sizes.update({b, b * 3 // 2} if b >= 2 else {b})
        b *= 2
    return sorted(s for s in sizes if s <= slots)


@dataclass
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    max_new: int


_WARMUP_STREAMS: dict[int, torch.cuda.Stream] = {}


def _warmup_stream() -> torch.cuda.Stream:
    """One side stream per device for every capture's warm-up: cuBLAS keeps a workspace per stream it
    ran on, so a new stream per (re)capture (colocation recaptures at every resume) would leave one
    more workspace allocated each time."""
    device = torch.cuda.current_device()
    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream()
    return _WARMUP_STREAMS[device]


class DecodeGraphs:
    """The slot-decode forward for each bucket: rows [0, b) read `tokens[:b]` at `cache.lengths[:b]`
    and return logits [b, V]. Captured once (largest first, one shared memory pool); replays read
    the same buffers, so weights updated in place and new slot contents need no recapture."""

    def __init__(self, model, cache: SlotCache, tokens: torch.Tensor, buckets: list[int], capture: bool,
                 adapters: torch.Tensor | None = None, route: Callable[[torch.Tensor], None] | None = None,
                 records: bool = False):
        """adapters / route: several LoRA adapters, each slot's adapter id and the call that routes by it.
        records: the steps record MoE routing (R3), captured ones into `records[bucket]`."""
        self.model, self.cache, self.tokens, self.buckets = model, cache, tokens, buckets
        self.adapters, self.route = adapters, route
        self.records: dict[int, dict] | None = {} if records else None  # bucket -> its graph's routing record
        self.views = {b: cache.first_rows(b) for b in buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def _forward(self, b: int, routing_record: dict | None = None) -> torch.Tensor:
        if self.route is not None:  # a view of the persistent buffer: what a captured graph reads
            self.route(self.adapters[:b, None])
        return self.model(self.tokens[:b, None], cache=self.views[b], routing_record=routing_record)[:, 0]

    @torch.no_grad()
    def _capture(self) -> None:
        # Warm-up runs on a side stream (as torch.cuda.graphs recommends) also fill the RoPE table
        # cache and pick the kernels; they write only column lengths (= 0) of empty slots.
        stream = _warmup_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in self.buckets:
                self._forward(b, None if self.records is None else {})
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for b in sorted(self.buckets, reverse=True):
            graph = torch.cuda.CUDAGraph()
            record = None if self.records is None else {}
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b, record)
            if record is not None:
                self.records[b] = record
            pool = graph.pool()
            self.graphs[b] = graph

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def run(self, b: int, routing_record: dict | None = None) -> torch.Tensor:
        """Logits [b, V] of one step; `routing_record` receives the MoE choices (a replay's: views of
        its graph's static outputs, valid until the next replay)."""
        if b in self.graphs:
            self.graphs[b].replay()
            if routing_record is not None:
                routing_record.update(self.records[b])
            return self.outputs[b]
        return self._forward(b, routing_record)


class GroupNoise:
    """Sampling noise for rows of seeded groups: `samples[r]` is the sample (g*n + j) row r decodes,
    or < 0 for a free row (noise 1: its token is masked anyway). Each draw takes one [n, vocab] block
    from the generator of every group present and gives row r row j of its group's block."""

    def __init__(self, generators: list[torch.Generator], n: int, samples: list[int], temperature: float,
                 device: torch.device):
        self.generators, self.n, self.temperature, self.size = generators, n, temperature, len(samples)
        self.groups = sorted({s // n for s in samples if s >= 0})
        block = {g: k for k, g in enumerate(self.groups)}
        rows = [r for r, s in enumerate(samples) if s >= 0]
        # Index tensors made once per plan (at a host check), not per decode step.
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.source = torch.tensor([block[samples[r] // n] * n + samples[r] % n for r in rows], dtype=torch.long,
                                   device=device)

    def draw(self, vocab: int) -> torch.Tensor | None:
        if self.temperature == 0:  # greedy: sample_next uses no noise, so none is drawn
            return None
        device = self.rows.device
        blocks = torch.cat([torch.empty(self.n, vocab, device=device).exponential_(generator=self.generators[g])
                            for g in self.groups])
        noise = torch.ones(self.size, vocab, device=device)
        noise[self.rows] = blocks[self.source]
        return noise


class SlotDecoder:
    def __init__(self, model, slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 pad_id: int, cuda_graphs: bool, sync_every: int = 8, buckets: list[int] | None = None,
                 routing: tuple[list[int], torch.dtype] | None = None,
                 route: Callable[[torch.Tensor], None] | None = None, pausable: PausableMemory | None = None):
        """routing: (MoE layers, id dtype) to record each sample's routed experts (captured steps too).
        route: several LoRA adapters, the engine's `LoRA.route` (generate's `adapters` then required).
        pausable: the engine's pausable memory (rollout.memory_saver): the cache's buffers live in its
        "kv_cache" region, and `pause` / `unpause` replace `release` / `allocate`."""
        self.model, self.slots, self.max_len, self.device = model, slots, max_len, device
        self.routing, self.route, self.pausable = routing, route, pausable
        self.paused = False
        self.pad_id, self.sync_every = pad_id, sync_every
        self.dtype, self.buckets = dtype, buckets or default_buckets(slots)
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self.allocate()
        if device.type == "cuda":
            self._warm_prefill(dtype)

    @torch.no_grad()
    def _warm_prefill(self, dtype: torch.dtype) -> None:
        """One small prefill at start, so the first generate call finds its kernels chosen and the
        fused ops compiled for multi-token shapes (the decode warm-up only saw one token per row)."""
        tokens = torch.full((2, 16), self.pad_id, dtype=torch.long, device=self.device)
        if self.route is not None:
            self.route(torch.zeros(2, 1, dtype=torch.long, device=self.device))
        hidden = self.model(tokens, cache=self.model.new_cache(2, 16, dtype=dtype, device=self.device),
                            return_hidden=True)
        self.model.logits_from_hidden(hidden[:, -1])

    # ----------------------------------------------------------------------------- memory (colocation)
    def allocate(self, capture: bool = True) -> None:
        """The slot cache, the per-slot state and (capture, when graphs are on) the decode graphs.
        `capture=False`: eager steps until `capture()` (the weights are not on the device yet)."""
        slots, device = self.slots, self.device
        region = self.pausable.region(KV_CACHE) if self.pausable is not None else contextlib.nullcontext()
        with region:  # only the layers' buffers: the per-slot state below stays through a pause
            layers = [layer.attn.new_cache(slots, self.max_len, self.dtype, device) for layer in self.model.layers]
        self.cache = SlotCache(layers, self.max_len, slots)
        self.tokens = torch.full((slots,), self.pad_id, dtype=torch.long, device=device)  # next input per slot
        self.live = torch.zeros(slots, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=device)  # ended on a stop token
        self.steps = torch.zeros(slots, dtype=torch.long, device=device)  # tokens generated so far
        self.adapters = torch.zeros(slots, dtype=torch.long, device=device)  # LoRA adapter per slot (route)
        self.out_tok = self.out_lp = self.out_routing = None  # per call (generate)
        self.graphs = self._graphs(capture=capture and self.cuda_graphs)

    def _graphs(self, capture: bool) -> DecodeGraphs:
        return DecodeGraphs(self.model, self.cache, self.tokens, self.buckets, capture, self.adapters, self.route,
                            records=self.routing is not None)

    def release(self) -> None:
        """Drop the slot cache, the per-slot state, the last call's outputs and the captured graphs
        (their memory pool with them); `allocate()` builds them again. Idempotent."""
        self.drop_graphs()
        self.cache = self.tokens = self.live = self.stopped = self.steps = self.adapters = self.graphs = None
        self.out_tok = self.out_lp = self.out_routing = None

    def pause(self) -> None:
        """Give the cache's memory back and keep its addresses (rollout.memory_saver): the per-slot
        state and the captured graphs stay, so `unpause` needs no capture."""
        self.pausable.pause(KV_CACHE)
        self.paused = True

    def unpause(self) -> None:
        """The cache's memory back at its addresses, zeroed (a pause keeps no contents, and masked
        columns must not hold NaN bit patterns), every slot empty."""
        self.pausable.resume(KV_CACHE)
        for layer in self.cache.layers:
            for t in layer.tensors():
                t.zero_()
        self.cache.length.zero_()
        self.paused = False

    def drop_graphs(self) -> None:
        """Forget the captured graphs (they hold the addresses of the weights and of the cache):
        eager steps until `capture()`."""
        if self.graphs is not None and self.graphs.graphs:
            self.graphs = self._graphs(capture=False)

    def capture(self) -> None:
        """Capture the decode graphs if they are on and not captured (after `allocate(capture=False)`
        or `drop_graphs()`, once the weights are back on the device)."""
        if self.cuda_graphs and self.graphs is not None and not self.graphs.graphs:
            self.graphs._capture()

    @property
    def allocated(self) -> bool:
        return self.cache is not None

    def nbytes(self) -> int:
        """Device bytes of the slot cache (every layer's buffers; 0 while released or paused)."""
        if self.cache is None or self.paused:
            return 0
        return self.cache.nbytes()

    @property
    def captured(self) -> bool:
        return self.graphs is not None and bool(self.graphs.graphs)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling, stop_ids: torch.Tensor,
                 generator: torch.Generator, generators: list[torch.Generator] | None = None,
                 adapters: list[int] | None = None) -> list[tuple[list[int], list[float], bool, torch.Tensor | None]]:
        """(response ids, log-probs, ended on a stop token, routed experts or None) per sample, row
        i*n+j answering prompts[i]. `generators`: one per prompt, its group's noise (else `generator`).
        `adapters`: one LoRA adapter id per prompt (with `route`)."""
        if self.cache is None or self.paused:
            raise RuntimeError("the slot cache is released: allocate() it first (NativeEngine.resume_memory)")
        if (adapters is None) != (self.route is None):
            raise ValueError("adapters: one LoRA adapter id per prompt exactly when the decoder routes by them")
        if n > self.slots:
            raise ValueError(f"n_samples_per_prompt ({n}) exceeds the engine's {self.slots} slots")
        cap = sampling.max_new
        # One spare column: rows that already finished keep writing (pad) at a frozen column <= cap.
        self.out_tok = torch.full((self.slots, cap + 1), self.pad_id, dtype=torch.long, device=self.device)
        self.out_lp = torch.zeros(self.slots, cap + 1, device=self.device)
        self.out_routing, self.prompt_routing = None, {}  # per slot [cap, L, k]; per prompt [len, L, k]
        if self.routing is not None:
            layers, dtype = self.routing
            k = self.model.config.moe.num_experts_per_tok
            self.out_routing = torch.zeros(self.slots, cap, len(layers), k, dtype=dtype, device=self.device)
        # Slots left from an earlier call ride along in the bucket: their step counters index this
        # call's output columns, so they restart (a multi-turn call may have a smaller cap).
        self.live.zero_()
        self.steps.zero_()
        results: list = [None] * (len(prompts) * n)
        owner = [-1] * self.slots  # sample index decoded in each slot
        waiting = deque(range(len(prompts)))
        while waiting or any(o >= 0 for o in owner):
            free = [s for s in range(self.slots) if owner[s] < 0]
            admit = []
            while waiting and len(free) >= n * (len(admit) + 1):
                admit.append(waiting.popleft())
            if admit:
                dst = free[: n * len(admit)]
                for k, group in enumerate(admit):
                    for j in range(n):
                        owner[dst[k * n + j]] = group * n + j
                noise = None if generators is None else \
                    GroupNoise(generators, n, [g * n + j for g in admit for j in range(n)], sampling.temperature,
                               self.device)
                routing = self._admit([prompts[g] for g in admit], n, dst, sampling, stop_ids, generator, noise,
                                      None if adapters is None else [adapters[g] for g in admit])
                self.prompt_routing.update(zip(admit, routing))
            if not waiting:
                self._compact(owner)
            rows = max(s for s in range(self.slots) if owner[s] >= 0) + 1
            bucket = self.graphs.bucket(rows)
            # Slots keep their owners until the next host check: one noise plan serves these steps.
            noise = None if generators is None else GroupNoise(generators, n, owner[:bucket], sampling.temperature,
                                                                 self.device)
            for _ in range(self.sync_every):
                self._step(bucket, sampling, stop_ids, generator, noise)
            self._collect(owner, rows, results, n)
        self.prompt_routing = {}
        return results

    def _admit(self, groups: list[list[int]], n: int, dst: list[int], sampling: Sampling,
               stop_ids: torch.Tensor, generator: torch.Generator,
               noise: GroupNoise | None = None, adapters: list[int] | None = None) -> list[torch.Tensor | None]:
        """Prefill each prompt once, copy its KV to its n slots, sample every slot's first token.
        Returns each prompt's routed experts [len, L, k] (None each without recording).
        `adapters`: each prompt's LoRA adapter id (several adapters), its slots' from now on."""
        width = max(map(len, groups))
        if width + sampling.max_new > self.max_len:
            raise ValueError(f"prompt ({width} tokens) + max_new_tokens ({sampling.max_new}) exceeds the "
                             f"engine's {self.max_len} cache columns; raise rollout.max_prompt_len")
        tokens = torch.full((len(groups), width), self.pad_id, dtype=torch.long)
        for i, ids in enumerate(groups):
            tokens[i, : len(ids)] = torch.tensor(ids)
        lengths = torch.tensor([len(ids) for ids in groups])
        tokens, lengths = tokens.to(self.device), lengths.to(self.device)
        prefill = self.model.new_cache(len(groups), width, dtype=self.cache.dtype, device=self.device)
        # Right padding: every real token precedes the pads, so plain causal attention is exact.
        record = None if self.routing is None else {}
        src = torch.arange(len(groups), device=self.device).repeat_interleave(n)
        slots = torch.tensor(dst, device=self.device)
        if adapters is not None:
            prompt_adapters = torch.tensor(adapters, dtype=torch.long, device=self.device)
            self.route(prompt_adapters[:, None])
            self.adapters[slots] = prompt_adapters[src]
        hidden = self.model(tokens, cache=prefill, return_hidden=True, routing_record=record)
        last = hidden[torch.arange(len(groups), device=self.device), lengths - 1]  # [P, hidden]
        logits = self.model.logits_from_hidden(last)
        self.cache.load_prefill(slots, prefill, src, width)
        self.cache.lengths[slots] = lengths[src]
        token, logp = sample_next(logits[src], sampling.temperature, sampling.top_p, sampling.top_k, generator,
                                  noise=None if noise is None else noise.draw(logits.shape[-1]))
        self.out_tok[slots] = self.pad_id
        self.out_tok[slots, 0], self.out_lp[slots, 0] = token, logp
        hit = torch.isin(token, stop_ids)
        self.stopped[slots], self.steps[slots], self.tokens[slots] = hit, 1, token
        self.live[slots] = ~hit & (sampling.max_new > 1)
        if record is None:
            return [None] * len(groups)
        routing = stack_routing(record, self.routing[0], self.routing[1])  # [P, width, L, k]
        return [routing[i, : len(ids)] for i, ids in enumerate(groups)]

    def _step(self, b: int, sampling: Sampling, stop_ids: torch.Tensor, generator: torch.Generator,
              noise: GroupNoise | None = None) -> None:
        """One token for rows [0, b): graph forward, then sampling and bookkeeping on the device."""
        record = None if self.routing is None else {}
        logits = self.graphs.run(b, record)
        if record is not None:  # each row's input is its response token steps - 1 (slots never used: 0)
            column = (self.steps[:b] - 1).clamp(min=0)
            self.out_routing[torch.arange(b, device=self.device), column] = \
                stack_routing(record, self.routing[0], self.routing[1])[:, 0]
        live = self.live[:b]
        self.cache.lengths[:b] += live  # the input token is now in the cache (finished rows stay put)
        token, logp = sample_next(logits, sampling.temperature, sampling.top_p, sampling.top_k, generator,
                                  noise=None if noise is None else noise.draw(logits.shape[-1]))
        token = torch.where(live, token, self.pad_id)
        column = self.steps[:b, None]
        self.out_tok[:b].scatter_(1, column, token[:, None])
        self.out_lp[:b].scatter_(1, column, logp[:, None])
        self.steps[:b] += live
        hit = live & torch.isin(token, stop_ids)
        self.stopped[:b] |= hit
        self.live[:b] = live & ~hit & (self.steps[:b] < sampling.max_new)
        self.tokens[:b] = token

    def _collect(self, owner: list[int], rows: int, results: list, n: int) -> None:
        """Hand finished slots' responses to `results` and free the slots (one host sync)."""
        live = self.live[:rows].tolist()
        done = [s for s in range(rows) if owner[s] >= 0 and not live[s]]
        if not done:
            return
        index = torch.tensor(done, device=self.device)
        tok, lp = self.out_tok[index].tolist(), self.out_lp[index].tolist()
        steps, stopped = self.steps[index].tolist(), self.stopped[index].tolist()
        routing = None if self.out_routing is None else self.out_routing[index].cpu()
        for k, s in enumerate(done):
            experts = None
            if routing is not None:  # fresh tensors (cat copies): no view of the buffer travels
                experts = torch.cat([self.prompt_routing[owner[s] // n].cpu(), routing[k, : steps[k] - 1]])
            results[owner[s]] = (tok[k][: steps[k]], lp[k][: steps[k]], stopped[k], experts)
            owner[s] = -1

    def _compact(self, owner: list[int]) -> None:
        """Move live slots above the smallest bucket that could hold them into free slots below it."""
        used = [s for s in range(self.slots) if owner[s] >= 0]
        if not used:
            return
        target = self.graphs.bucket(len(used))
        if self.graphs.bucket(used[-1] + 1) == target:
            return
        high = [s for s in used if s >= target]
        low = [s for s in range(target) if owner[s] < 0][: len(high)]
        dst, src = torch.tensor(low, device=self.device), torch.tensor(high, device=self.device)
        self.cache.move_rows(dst, src)
        for state in (self.tokens, self.live, self.stopped, self.steps, self.adapters, self.out_tok, self.out_lp,
                      self.out_routing):
            if state is not None:
                state[dst] = state[src]
        self.live[src] = False
        for d, s in zip(low, high):
            owner[d], owner[s] = owner[s], -1

