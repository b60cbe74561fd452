"""What the collective transports (broadcast, shared memory) share in the loop: a group over the
trainer and every engine process, set up at the first sync and again after an actor was replaced.

    transport = CollectiveTransport(TransportName.broadcast, components, setup)
    transport.sync(check)   # (re)sets the group up when needed, then syncs through it

`setup(trainer, engines, generation)` builds the group (a `BroadcastWeightSync`, a
`SharedMemoryWeightSync`) over the trainer's handle and the per-engine handles; `generation` counts
the setups (1, 2, ...), for names that must not meet an old group's. A restart (miles/orchestrate:
the supervisor's `RayHandle.restart`, an `EngineFleet` failover) replaces the actor behind a handle:
the new actor is no member of the old group, so the next sync sets one up again. The old group is
abandoned, not closed: its dead member cannot leave it, and the live ones' ends go with the process
or are replaced by the new setup.

An `EngineFleet` restarting an engine itself (inside a generate call) gives it the trainer's weights
through the object store (its `weights_source`, set where the fleet is built): the fleet's own last
`update_weights` never happened when a collective syncs around it.
"""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, wait
from typing import Any, Callable, Protocol

from miles.transport.protocol import Components, TransportName


class Group(Protocol):
    def sync(self, check: bool) -> tuple[str, float]: ...  # (digest, seconds)

    def close(self) -> None: ...

    def abandon(self) -> None: ...  # drop the driver's side only (a member is gone)


# After a member's error, how long the others' get to report: a dead actor's peers see a closed
# connection first, its own death is reported moments later; longer is a member blocked in a
# collective whose sender failed (it waits for the group's timeout).
DEATH_REPORT_S = 5.0


def results(futures: list) -> list:
    """The members' results, in order. When some failed, the error raised is a member actor's death
    where one was reported: it explains the others' (a peer's closed connection), and it is what the
    supervisor restarts an engine for."""
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    if any(future.exception() is not None for future in done):
        wait(futures, timeout=DEATH_REPORT_S)
        errors = [future.exception() for future in futures if future.done() and future.exception() is not None]
        raise next((error for error in errors if _is_actor_death(error)), errors[0])
    return [future.result() for future in futures]


def _is_actor_death(error: BaseException) -> bool:
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # no Ray: every member is in this process
        return False
    return isinstance(error, RayActorError)


def actor_of(handle: Any) -> Any:
    """The Ray actor behind a handle (`RayHandle.actor`, replaced by a restart), or the in-process handle."""
    return getattr(handle, "actor", handle)


class CollectiveTransport:
    snapshots = False  # the engines take part in the sync: they must be idle

    def __init__(self, name: TransportName, components: Components,
                 setup: Callable[[Any, list, int], Group]):
        self.name, self.setup = name, setup
        # The handles as built: a restart replaces the actor behind one, not the handle.
        self.trainer, self.engines = components.trainer, list(components.engine.members)
        self.group: Group | None = None
        self.actors: tuple = ()
        self.setups = 0

    def sync(self, check: bool) -> float:
        actors = tuple(actor_of(handle) for handle in [self.trainer, *self.engines])
        if self.group is None or any(a is not b for a, b in zip(actors, self.actors)):
            if self.group is not None:
                self.group.abandon()
            self.setups += 1
            self.group = self.setup(self.trainer, self.engines, self.setups)
            self.actors = actors
        return self.group.sync(check)[1]

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
