"""The weight transport protocol, its names (`rollout.weight_sync`) and the registry that builds one.

A transport moves the trainer's current weights into every rollout engine and, with `check`, makes
each engine verify what it then holds against the trainer's checksum (miles/transport/checksum.py:
`WeightSyncError` on a mismatch). The loops hold one (`LoopContext.transport`) and never ask which:

    transport = build_transport(TransportName.broadcast, components, TransportOptions(bucket_mb=64))
    seconds = transport.sync(check=True)           # each step, the engines idle
    transport.close()

    if transport.snapshots:                        # the asynchronous rollout (orchestrate/rollout_ahead.py)
        snapshot = transport.fetch()               # after a train step, while the engine generates
        transport.load(snapshot, check=True)       # later, between two collections

`components` is what holds the two handles (miles/orchestrate/handles.py: `LocalHandle`, `RayHandle`,
or an `EngineFleet` of several engines): the loop's `LoopContext`, or anything with a `trainer` and an
`engine`. A transport that loads through the engine API (the object store) reads them at every call,
so a handle the supervisor wrapped later (restarts) is the one it calls; a collective (broadcast,
shared memory) reaches every engine's process through `engine.members`, the per-engine handles, taken
when it is built, and is set up again when an actor behind one of them was replaced
(miles/transport/collective.py).

A new transport: one module with a `build(components, options) -> WeightTransport`, its name in
`TransportName` and `_MODULES` below, and tests/transport_contract.py run against it
(tests/unit/transport/test_transport_contract.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from miles.choice import Choice


class TransportName(Choice):
    """rollout.weight_sync: how the trainer's weights reach the engines (the config's field is of this
    Enum, so the names the config accepts are the names this registry builds)."""
    object_store = "object_store"  # host state dicts through Ray's object store; in-process: a flat device copy
    broadcast = "broadcast"  # a gloo / NCCL group of the trainer and the engines, in buckets
    shared_memory = "shared_memory"  # one buffer the engines map: /dev/shm on the CPU, CUDA IPC on a GPU


@dataclass(frozen=True)
class TransportOptions:
    """The transports' own options (each reads its fields; the run fills them from `rollout.*`)."""
    bucket_mb: float = 64.0  # broadcast: bytes per collective (rollout.weight_sync_bucket_mb)
    backend: str = "gloo"  # broadcast: the process group's backend, gloo or nccl
    timeout_s: float = 600.0  # broadcast: how long a member waits in a collective for the others


class Components(Protocol):
    """What a transport is built over: the trainer's handle and the engine side's (one engine or a fleet)."""
    trainer: Any
    engine: Any


@runtime_checkable
class WeightTransport(Protocol):
    name: TransportName
    # True: `fetch` / `load` split a sync in two (a snapshot taken now, loaded later, the engine busy
    # in between); False: a collective, the engines must be idle for the whole `sync`.
    snapshots: bool

    def sync(self, check: bool) -> float:
        """Push the trainer's current weights into every engine; with `check` each engine verifies
        what it then holds (WeightSyncError). Returns the seconds it took."""
        ...

    def close(self) -> None:
        """Release what the transport set up (groups, buffers); a closed transport is not used again."""
        ...


# A lazy registry: each transport's module is imported when it is built (broadcast needs
# torch.distributed's process groups, shared memory /dev/shm), never by naming the protocol.
_MODULES = {
    TransportName.object_store: "miles.transport.object_store",
    TransportName.broadcast: "miles.transport.broadcast",
    TransportName.shared_memory: "miles.transport.shared_memory",
}


def build_transport(name: TransportName | str, components: Components,
                    options: TransportOptions = TransportOptions()) -> WeightTransport:
    """The transport `name` (a TransportName or its `rollout.weight_sync` string) over `components`."""
    try:
        name = TransportName(name)
    except ValueError:
        valid = ", ".join(n.value for n in TransportName)
        raise ValueError(f"rollout.weight_sync={name!r} is unknown; valid: {valid}") from None
    transport = importlib.import_module(_MODULES[name]).build(components, options)
    assert transport.name == name, f"{_MODULES[name]}.build made a {transport.name} transport"
    return transport
