"""`rollout.weight_sync=object_store` (the default, and the fallback that works everywhere): the
trainer's `get_weights()` and the engine's `update_weights(weights, checksum)`, through the handles.

Through Ray the weights are a host state dict in the rollout dtype (or the FP8 / INT4 payload) in
Ray's object store, passed from the trainer's future to the engine's call without a copy through the
driver (tensors of every dtype as raw bytes: miles/transport/ray_tensors.py); the checksum is
checksum.checksum's SHA-256 (or the recipe's for quantized payloads). With both components in this
process the trainer hands over its flat sync buffer on its device instead (miles/transport/flat.py),
checked by a device checksum: one device-to-device copy, no host hop.

The only transport whose sync splits in two (`snapshots`): `fetch` takes the trainer's weights as
futures, `load` puts them into the engine later; the asynchronous rollout generates in between.
"""

from __future__ import annotations

import time

from miles.transport.protocol import Components, TransportName, TransportOptions


class ObjectStoreTransport:
    name = TransportName.object_store
    snapshots = True

    def __init__(self, components: Components):
        # The handles are read at every call: a handle wrapped after this was built is the one called.
        self.components = components

    def fetch(self) -> tuple:
        """(weights, digest) of the trainer's current weights, as futures of its handle. Both in this
        process: the trainer's flat sync buffer, refilled by its next fetch (load it before that)."""
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
        self.load(self.fetch(), check)
        return time.perf_counter() - start

    def close(self) -> None:
        pass  # nothing set up: every sync goes through the handles


def build(components: Components, options: TransportOptions) -> ObjectStoreTransport:
    return ObjectStoreTransport(components)
