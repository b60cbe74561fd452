"""`rollout.weight_sync=object_store` (the default, and the fallback that works everywhere): the
trainer's `get_weights()` and the engine's `update_weights(weights, checksum)`, through the handles.

Through Ray the weights are a host state dict in the rollout dtype (or the FP8 / INT4 payload) in
Ray's object store, passed from the trainer's future to the engine's call without a copy through the
driver (tensors of every dtype as raw bytes: miles/transport/ray_tensors.py); the checksum is
checksum.checksum's SHA-256 (or the recipe's for quantized payloads). With both components in this
process the trainer hands over its flat sync buffer on its device instead (miles/transport/flat.py),
checked by a device checksum: one device-to-device copy, no host hop.

Same node, CPU: a whole `sync()` (not the `fetch` / `load` snapshots) of a native trainer and a native
engine that are Ray actors on one node goes through a shared-memory segment instead
(miles/transport/shared_memory.py, set up at the first sync): the trainer packs its weights into
/dev/shm, the engine copies them from there, each side computes the same SHA-256 as above, so the
engine holds and verifies exactly what the object store would have brought. Why: for the default
model (2.4 MB) the object store's hop took ~5 ms of a ~12 ms Ray sync (docs/benchmarks.md, issue 28).
Anything else (another node, a GPU, LoRA adapters, FSDP ranks, other engine backends, a /dev/shm
without room) keeps the object store. Both in one Ray actor (`ray.hybrid`, miles/orchestrate/hybrid.py):
the in-process copy above, run inside that actor. The snapshots stay in the object store: a snapshot must outlive
the trainer's next refill of the segment.

The only transport whose sync splits in two (`snapshots`): `fetch` takes the trainer's weights as
futures, `load` puts them into the engine later; the asynchronous rollout generates in between.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from miles.transport.protocol import Components, TransportName, TransportOptions


def _shares_segment_as_trainer(trainer: Any) -> bool:
    """Runs in the trainer's process: a one-process native trainer on the CPU syncing its whole policy."""
    from miles.trainer.torch_trainer import TorchTrainer

    return (isinstance(trainer, TorchTrainer) and trainer.lora is None and trainer.device.type == "cpu"
            and not trainer.parallel.shards_policy and trainer.parallel.in_process_weights)


def _shares_segment_as_engine(engine: Any) -> bool:
    """Runs in the engine's process: a native engine on the CPU without LoRA adapters."""
    from miles.rollout.native import NativeEngine

    return isinstance(engine, NativeEngine) and engine.lora is None and engine.device.type == "cpu"


class ObjectStoreTransport:
    name = TransportName.object_store
    snapshots = True

    def __init__(self, components: Components):
        # The handles are read at every call: a handle wrapped after this was built is the one called.
        self.components = components
        # The same-node segment for sync(): None until the first Ray sync decides, False where it
        # does not apply (then every sync goes through the object store).
        self._segment: Any = None

    def fetch(self) -> tuple:
        """(weights, digest) of the trainer's current weights, as futures of its handle. Both in this
        process: a flat buffer of the trainer's device that only the snapshot holds."""
        trainer, engine = self.components.trainer, self.components.engine
        in_process = {"in_process": True} if engine.in_process and trainer.in_process else {}
        return tuple(trainer.submit("get_weights", num_returns=2, **in_process))

    def load(self, snapshot: tuple, check: bool) -> None:
        """Load a fetched snapshot into the engine (a fleet: every engine); with `check`, verified."""
        weights, digest = snapshot
        engine = self.components.engine
        engine.get(engine.submit("update_weights", weights, digest if check else None))

    def sync(self, check: bool) -> float:
        start = time.perf_counter()
        trainer, engine = self.components.trainer, self.components.engine
        if getattr(trainer, "same_process", lambda other: False)(engine):
            trainer.sync_in_process(check)  # one Ray actor holds both (ray.hybrid): its in-process copy
        elif segment := self._same_node_segment():
            segment.sync(check)
        else:
            self.load(self.fetch(), check)
        return time.perf_counter() - start

    def _same_node_segment(self):
        """The shared-memory transport over these handles where it applies (see the module doc), else False."""
        if self._segment is not None:
            return self._segment
        trainer, engine = self.components.trainer, self.components.engine
        self._segment = False
        members = getattr(engine, "members", [engine])
        if trainer.in_process or engine.in_process or len(members) != 1:
            return False
        if not (trainer.apply(_shares_segment_as_trainer) and engine.apply(_shares_segment_as_engine)):
            return False
        from miles.transport.collective import actor_of
        from miles.transport.shared_memory import SharedMemoryWeightSync, build

        try:
            group = SharedMemoryWeightSync(trainer, [engine])
        except (ValueError, OSError, RuntimeError):  # another node, no room on /dev/shm: the object store
            return False
        # The loop's collective transport over the same handles (it sets the segment up again after an
        # engine restart), starting from the segment set up here.
        segment = build(SimpleNamespace(trainer=trainer, engine=SimpleNamespace(members=[engine])), TransportOptions())
        segment.group, segment.actors, segment.setups = group, (actor_of(trainer), actor_of(engine)), 1
        self._segment = segment
        return segment

    def close(self) -> None:
        if self._segment:
            self._segment.close()
        self._segment = None


def build(components: Components, options: TransportOptions) -> ObjectStoreTransport:
    return ObjectStoreTransport(components)
