"""`ray.hybrid`: the rollout engine and the trainer in one Ray actor, as verl's hybrid engine does.

    worker = spawn(HybridWorker, True, {"engine": (engine_cls, args, kwargs),
                                        "trainer": (trainer_cls, args, kwargs)}, num_gpus=share)
    engine, trainer = PartHandle(worker, "engine"), PartHandle(worker, "trainer")

The two handles speak the handle protocol (miles/orchestrate/handles.py) to their part of the one
actor, so the loops, the checkpoints and the debug checks call them as they call two actors. The
weight sync is the in-process one, run inside the actor (the trainer's flat buffer copied into the
engine's, checked by the device checksum): no state dict through the object store, no SHA-256 on
each side. The two parts share one OpenMP team on the CPU (two actors' teams spin on each other's
cores) and one CUDA context and allocator on a GPU.

What it changes for faults: the engine cannot die alone. A dead worker is a failed trainer: the
supervisor builds both again and resumes from the last checkpoint (miles/orchestrate/supervise.py).
Which runs get it: miles/config/hybrid_rules.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from miles.orchestrate.handles import LocalHandle, RayHandle, settle_heap
from miles.transport.object_store import ObjectStoreTransport


class HybridWorker:
    """Builds its parts in the order given (the engine first, as an in-process run does) and runs
    each call on the named part; one call at a time, as any Ray actor."""

    def __init__(self, parts: dict[str, tuple[type, tuple, dict]]):
        self.parts = {name: cls(*args, **kwargs) for name, (cls, args, kwargs) in parts.items()}
        local = SimpleNamespace(**{name: LocalHandle(part) for name, part in self.parts.items()})
        self.transport = ObjectStoreTransport(local)  # both handles in process: the flat device copy
        settle_heap()  # the actor's long-lived objects out of its full collections

    def call(self, part: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.parts[part], method)(*args, **kwargs)

    def run(self, part: str, fn: Any, *args: Any) -> Any:
        return fn(self.parts[part], *args)

    def sync_weights(self, check: bool) -> float:
        return self.transport.sync(check)


class PartHandle:
    """The handle of one part of a HybridWorker actor. `actor` is the worker's, so what kills or
    records a component's actor (teardown, tests) reaches the worker; `in_process` is False for
    the driver (tensors cross the object store), `same_process` tells the transport otherwise."""

    in_process = False

    def __init__(self, worker: RayHandle, part: str):
        self.worker, self.part = worker, part

    @property
    def actor(self) -> Any:
        return self.worker.actor

    @property
    def members(self) -> list["PartHandle"]:
        return [self]

    def submit(self, method: str, *args: Any, num_returns: int = 1, **kwargs: Any) -> Any:
        remote = self.actor.call if num_returns == 1 else self.actor.call.options(num_returns=num_returns)
        return remote.remote(self.part, method, *args, **kwargs)

    def get(self, future: Any) -> Any:
        return self.worker.get(future)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.get(self.submit(method, *args, **kwargs))

    def apply(self, fn: Any, *args: Any) -> Any:
        return self.get(self.actor.run.remote(self.part, fn, *args))

    def same_process(self, other: Any) -> bool:
        return isinstance(other, PartHandle) and other.actor is self.actor

    def sync_in_process(self, check: bool) -> float:
        """The worker's own weight sync, trainer part -> engine part (the object store transport's
        in-process path, run inside the actor); the seconds it took there."""
        return self.get(self.actor.sync_weights.remote(check))
