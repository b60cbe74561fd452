"""A fleet of rollout engines behind one engine API: work-queue dispatch and failover.

`EngineFleet` holds N engine handles (miles/orchestrate/handles.py: all in-process or all Ray
actors) and answers `generate` as one engine would: samples in prompt order, groups contiguous,
`Sample.group` numbered over the whole call. The prompt groups are cut into chunks; each engine
takes the next chunk as soon as it has none running (Ray engines run theirs concurrently), so an
engine that finishes early takes more. With per-group `seeds` (miles/rollout/native.py) a group's
samples do not depend on the engine or the chunk that ran it, so N engines give the samples of one.

Failover (Ray): when an engine actor dies, the chunk it was running goes back to the front of the
queue for the next free engine, the actor is restarted and given the last weights the fleet sent,
then takes chunks again; every group is returned once. Any other error (a bad input, a weight
checksum mismatch) is raised, not retried.

    fleet = EngineFleet([spawn(NativeEngine, True, ckpt, cfg) for _ in range(2)])
    fleet.update_weights(weights, digest)            # -> one checksum per engine
    samples = fleet.generate(prompts, labels, n=8, seeds=[step * 10_000 + i for i in range(len(prompts))])

The fleet also speaks the handle protocol (`call` / `submit` / `get`, `in_process`), so the loop
can hold it where it holds an engine handle: `ctx.engine.call("generate", ...)`.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from miles.rollout.protocol import TAGS as ENGINE_TAGS
from miles.types import Sample

# Chunks per engine in one call (N > 1): enough for an early finisher to take over a share of the
# last ones, few enough that each engine still decodes large batches.
CHUNKS_PER_ENGINE = 2


class EngineFleet:
    def __init__(self, engines: list, chunk_groups: int | None = None, max_restarts: int = 3,
                 log: Callable[[str], None] = print):
        """engines: LocalHandle or RayHandle (with respawn) of each engine, all of one kind.
        chunk_groups: prompt groups per chunk (None: about CHUNKS_PER_ENGINE chunks per engine).
        max_restarts: engine restarts over the fleet's life before an actor death is raised."""
        if not engines:
            raise ValueError("EngineFleet needs at least one engine")
        if len({handle.in_process for handle in engines}) > 1:
            raise ValueError("EngineFleet: engines are all in-process or all Ray actors, not a mix")
        self.engines, self.chunk_groups, self.log = list(engines), chunk_groups, log
        self.restarts_left = max_restarts
        self.weights: tuple[Any, str | None] | None = None  # the last update_weights arguments
        self.restarts = [0] * len(engines)  # per engine, for logs and tests
        # () -> (weights, checksum) for a restarted engine when no update_weights came through the
        # fleet (a collective transport syncs each engine itself): set where the fleet is built.
        self.weights_source: Callable[[], tuple[Any, Any]] | None = None

    @property
    def in_process(self) -> bool:
        return self.engines[0].in_process

    @property
    def members(self) -> list:
        """The per-engine handles (what a collective weight transport joins, one process each)."""
        return list(self.engines)

    # ------------------------------------------------------------------ the engine API

    def generate(self, prompts: list[str], labels: list[str], n: int = 1, temperature: float | None = None,
                 max_new_tokens: int | None = None, prompt_ids: list[list[int]] | None = None,
                 seeds: list[int] | None = None, adapters: list[int] | None = None,
                 images: list[dict | None] | None = None) -> list[Sample]:
        """NativeEngine.generate over the fleet: samples[i*n:(i+1)*n] answer prompts[i]. Without
        `seeds` each engine samples from its own generator, so the samples depend on the dispatch.
        `adapters`: each prompt's LoRA adapter id (several adapters), `images`: each prompt's vision
        inputs (a VLM), travelling with their prompt."""
        for name, values in (("seeds", seeds), ("adapters", adapters), ("images", images)):
            if values is not None and len(values) != len(prompts):
                raise ValueError(f"{name}: one per prompt, got {len(values)} for {len(prompts)} prompts")
        groups = len(prompts)
        size = self.chunk_groups or max(1, groups if len(self.engines) == 1 else
                                        math.ceil(groups / (CHUNKS_PER_ENGINE * len(self.engines))))
        queue = deque(range(start, min(start + size, groups)) for start in range(0, groups, size))

        def args(chunk: range) -> tuple[tuple, dict]:
            part = slice(chunk.start, chunk.stop)
            per_prompt = {"prompt_ids": prompt_ids, "seeds": seeds, "adapters": adapters, "images": images}
            return (prompts[part], labels[part], n, temperature, max_new_tokens), {
                name: values[part] for name, values in per_prompt.items() if values is not None}

        done: dict[int, list[Sample]] = {}
        for chunk, samples in self._run(queue, "generate", args):
            for s in samples:  # the engine numbered the groups of its chunk from 0
                s.group += chunk.start
            done[chunk.start] = samples
        return [s for start in sorted(done) for s in done[start]]

    def update_weights(self, weights: Any, expected_checksum: str | None = None) -> list[str]:
        """Load the trainer's weights into every engine (concurrently); the checksum each holds.
        Kept: an engine restarted later is given these before it takes work."""
        if not self.in_process:
            import ray

            # One copy in the object store for every engine (and any restart), not one per call.
            weights = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        self.weights = (weights, expected_checksum)
        running = {self._submit(i, "update_weights", *self.weights): i for i in range(len(self.engines))}
        held: dict[int, str] = {}
        while running:
            future = self._wait(running)
            i = running.pop(future)
            try:
                held[i] = self._get(i, future)
            except Exception as error:
                if not self._died(i, error):
                    self._settle(running)
                    raise
                running[self._restart(i, error)] = i  # the restart loads these weights
        return [held[i] for i in range(len(self.engines))]

    def update_draft_weights(self, weights: Any, expected_checksum: str | None = None) -> list[str]:
        """The online-trained speculative draft model to every engine (an engine restarted later
        starts from its draft checkpoint until the next sync)."""
        return self._on_each("update_draft_weights", weights, expected_checksum)

    def decode(self, ids: list[int]) -> str:
        return self.engines[0].call("decode", ids)  # every engine holds the same tokenizer

    def release_memory(self, tags: tuple[str, ...] = ENGINE_TAGS, keep_weights: bool = True) -> None:
        """Every engine releases (colocation: the trainer's turn), with the caller's arguments."""
        self._on_each("release_memory", tags, keep_weights=keep_weights)

    def resume_memory(self, tags: tuple[str, ...] = ENGINE_TAGS) -> None:
        self._on_each("resume_memory", tags)

    def health(self) -> list[dict]:
        return self._on_each("health")

    def _on_each(self, method: str, *args: Any, **kwargs: Any) -> list:
        futures = [handle.submit(method, *args, **kwargs) for handle in self.engines]
        return [handle.get(f) for handle, f in zip(self.engines, futures)]

    def apply(self, fn: Callable, *args: Any) -> Any:
        """fn(engine 0, *args): what checkpoints save and restore of an engine (its generator and RNG)
        and the debug sync check read one engine. Seeded sampling does not use that state, and
        `update_weights` verifies every engine's checksum itself."""
        return self.engines[0].apply(fn, *args)

    def apply_all(self, fn: Callable, *args: Any) -> list:
        """fn(engine, *args) where each engine lives (checkpoint state, debug checks), in engine order."""
        return [handle.apply(fn, *args) for handle in self.engines]

    # ------------------------------------------------------------------ the handle protocol

    def submit(self, method: str, *args: Any, num_returns: int = 1, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)  # runs now; the value is its own future

    def get(self, future: Any) -> Any:
        return future

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)

    # ------------------------------------------------------------------ dispatch and failover

    def _run(self, queue: deque, method: str, args: Callable[[Any], tuple[tuple, dict]]):
        """Yield (item, result) for every item of `queue`, in completion order: an idle engine takes
        the next item and calls `method(*args(item))`; a dead engine's item goes back to the queue."""
        idle = deque(range(len(self.engines)))
        running: dict[Any, tuple[int, Any]] = {}  # future -> (engine, item; None: a restart's weight sync)
        while queue or running:
            while queue and idle:
                i, item = idle.popleft(), queue.popleft()
                call_args, kwargs = args(item)
                running[self._submit(i, method, *call_args, **kwargs)] = (i, item)
            future = self._wait(running)
            i, item = running.pop(future)
            try:
                result = self._get(i, future)
            except Exception as error:
                if not self._died(i, error):
                    self._settle(running)
                    raise
                if item is not None:  # its unfinished chunk: the next free engine runs it again
                    queue.appendleft(item)
                running[self._restart(i, error)] = (i, None)
                continue
            idle.append(i)
            if item is not None:
                yield item, result

    def _submit(self, i: int, method: str, *args: Any, **kwargs: Any) -> Any:
        handle = self.engines[i]
        if not handle.in_process:
            return handle.submit(method, *args, **kwargs)
        future: Future = Future()  # in-process: the call runs now; the future holds its value or error
        try:
            future.set_result(handle.call(method, *args, **kwargs))
        except Exception as error:
            future.set_exception(error)
        return future

    def _wait(self, running: dict) -> Any:
        """A finished future of `running` (in-process ones are all finished)."""
        if self.in_process:
            return next(iter(running))
        import ray

        ready, _ = ray.wait(list(running), num_returns=1)
        return ready[0]

    def _settle(self, running: dict) -> None:
        """Wait out the other engines' calls before an error propagates, their errors dropped: a
        failed sync usually fails on every engine, and Ray logs each error nobody collected as an
        "Unhandled error" after the real one."""
        for future, owner in running.items():
            try:
                self._get(owner if isinstance(owner, int) else owner[0], future)
            except Exception:  # noqa: BLE001 - the first error is the one raised
                pass

    def _get(self, i: int, future: Any) -> Any:
        return future.result() if self.in_process else self.engines[i].get(future)

    def _died(self, i: int, error: BaseException) -> bool:
        """Engine i's actor is gone (not an error its code raised, nor the death of another actor,
        e.g. a trainer whose weights it was loading)."""
        if self.in_process:
            return False
        from ray.exceptions import RayActorError

        return isinstance(error, RayActorError) and \
            error.actor_id in (None, self.engines[i].actor._actor_id.hex())

    def _restart(self, i: int, error: BaseException) -> Any:
        """Replace engine i's actor; returns the future of its weight sync (the last weights sent)."""
        if self.restarts_left <= 0:
            self.log(f"rollout engine {i} died; no restarts left")
            raise error
        self.restarts_left -= 1
        self.restarts[i] += 1
        self.log(f"rollout engine {i} died ({type(error).__name__}); restarting it, its work goes to the fleet")
        handle = self.engines[i]
        handle.restart()
        if self.weights is not None:  # what the other engines hold
            return handle.submit("update_weights", *self.weights)
        if self.weights_source is not None:  # weights that reach the engines another way (a collective)
            return handle.submit("update_weights", *self.weights_source())
        return handle.submit("__ray_ready__")  # nothing sent yet: it starts from the checkpoint, as the others
