"""Weight sync by broadcast over a torch.distributed group: trainer rank 0, rollout engines 1..N.

What SGLang and vLLM expose for RL (`init_weights_update_group` / `update_weights_from_distributed`),
for Miles' own components: the trainer sends its weights once, in buckets, and every engine receives
them at the same time (gloo on CPU, NCCL on GPU), instead of one host state dict per engine through
Ray's object store (miles/transport/object_store.py).

    sync = BroadcastWeightSync(trainer, engines, backend="gloo", bucket_mb=64)  # the group, once
    digest, seconds = sync.sync()       # each step: what get_weights -> update_weights did
    sync.close()

In the loop: `build_transport("broadcast", components, options)` (miles/transport/protocol.py).

How it runs:
- The group is a dedicated one, built from a TCPStore and the backend class itself
  (ProcessGroupGloo / ProcessGroupNCCL), outside torch.distributed's global registry: a process
  may already have a default group (an FSDP trainer rank) and nothing here touches or needs it.
  The trainer's process hosts the store on a port the OS picks; members join with handle.apply, so
  the components' classes need no method for it (LocalHandle members join from threads).
- Layout, once at setup: the trainer plans the buckets (names, dtypes, shapes, byte offsets) and the
  driver hands the plan to the engines through Ray; a sync then carries bytes only.
- A bucket is one uint8 buffer: its tensors packed back to back at 16-byte aligned offsets, whatever
  their dtypes (SGLang's "flattened_bucket" format). One collective per bucket, and float8 / packed
  int4 payloads cross too (gloo has no float8 broadcast). A tensor larger than `bucket_mb` goes
  alone in its bucket.
- Plain recipes: the trainer casts its master weights into the rollout dtype while packing (on its
  device; no full host copy). Quantized rollouts (FP8 / INT4): the bytes of `get_weights()`'s payload.
- Check: the trainer hashes what it sent (the SHA-256 of checksum.checksum, or get_weights' own
  checksum for quantized payloads) and broadcasts the digest last; each engine loads the received
  state dict with `update_weights(state_dict, digest)`, which verifies what it then holds.
- Backend: "gloo" (CPU buffers) or "nccl" (buffers on the current CUDA device; every member on a
  GPU of its own: NCCL refuses two ranks on one device, as colocated actors sharing a GPU are).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import BroadcastOptions, PrefixStore, TCPStore

from miles.transport.checksum import TORCH_DTYPES, hash_tensors
from miles.transport.collective import CollectiveTransport, results
from miles.transport.protocol import Components, TransportName, TransportOptions

ALIGN = 16  # bytes: every tensor's offset in a bucket, so that a byte slice views as any dtype
DIGEST_BYTES = 64  # a SHA-256 hex digest, broadcast after the last bucket
SENDER = 0


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a bucket."""
    name: str
    dtype: str  # torch dtype name without "torch.", as it crosses Ray
    shape: tuple[int, ...]
    offset: int  # bytes into the bucket
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    slots: tuple[Slot, ...]
    nbytes: int


def plan_buckets(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> tuple[Bucket, ...]:
    """Buckets of at most `bucket_bytes` (a larger tensor: a bucket of its own), names in sorted
    order: the order checksum.checksum hashes them in, so the sender hashes as it packs."""
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    end = 0
    for name in sorted(tensors):
        dtype, shape = tensors[name]
        nbytes = math.prod(shape) * dtype.itemsize
        offset = -(-end // ALIGN) * ALIGN
        if slots and offset + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), end))
            slots, offset = [], 0
        slots.append(Slot(name, str(dtype).removeprefix("torch."), tuple(shape), offset, nbytes))
        end = offset + nbytes
    if slots:
        buckets.append(Bucket(tuple(slots), end))
    return tuple(buckets)


def views(buffer: torch.Tensor, bucket: Bucket) -> dict[str, torch.Tensor]:
    """The bucket's tensors as typed views of its uint8 buffer."""
    return {s.name: buffer[s.offset: s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
            for s in bucket.slots}


def pack(buffer: torch.Tensor, bucket: Bucket, tensors: dict[str, torch.Tensor]) -> None:
    """Copy (and cast) the bucket's tensors into their places in `buffer`: one foreach call."""
    targets = views(buffer, bucket)
    names = [s.name for s in bucket.slots]
    torch._foreach_copy_([targets[n] for n in names], [tensors[n].detach() for n in names])


def check_plan(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None, buckets: tuple[Bucket, ...]) -> None:
    """Raise if these tensors (cast to `dtype` when given) are not the ones the buckets were planned for."""
    planned = {s.name: (s.dtype, s.shape) for b in buckets for s in b.slots}
    sent = {n: (str(dtype or t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}
    if sent != planned:
        raise ValueError(f"the trainer's weights no longer match the plan made at setup: "
                         f"{sorted(set(sent.items()) ^ set(planned.items()))[:3]}")


# ----------------------------------------------------------------------------- inside each member
@dataclass
class _Member:
    """This component's end of one group: the store (the sender hosts it) and the backend."""
    store: TCPStore
    backend: Any = None  # ProcessGroupGloo / ProcessGroupNCCL, once joined
    device: torch.device | None = None
    buckets: tuple[Bucket, ...] = ()

    def broadcast(self, buffer: torch.Tensor) -> None:
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = SENDER, 0
        self.backend.broadcast([buffer], opts).wait()


# component -> {group name: member}. Keyed by the component, not the process: in-process the
# trainer and the engines share one (each joins from a thread of its own).
_MEMBERS: "weakref.WeakKeyDictionary[Any, dict[str, _Member]]" = weakref.WeakKeyDictionary()


def _member(component: Any, group_name: str) -> _Member:
    try:
        return _MEMBERS[component][group_name]
    except KeyError:
        raise RuntimeError(f"no weight update group {group_name!r} here: BroadcastWeightSync sets it up") from None


def sender_tensors(trainer) -> tuple[dict[str, torch.Tensor], torch.dtype | None, str | None]:
    """(what the trainer sends, the dtype to cast it to while packing or None, its checksum if known).
    Plain recipes: the master weights where they live, cast per bucket; quantized rollouts: the
    payload and checksum get_weights builds (the quantization lives there)."""
    if trainer.recipe.rollout_quant == "none":  # a trainer whose model holds other names (Megatron) says what it sends
        state = trainer.sync_state() if hasattr(trainer, "sync_state") else trainer.model.state_dict()
        return state, TORCH_DTYPES[trainer.precision.rollout_dtype], None
    payload, digest = trainer.get_weights()
    return payload, None, digest


def _listen(trainer, group_name: str, bucket_bytes: int, timeout_s: float) -> tuple[str, int, tuple[Bucket, ...]]:
    """Rank 0, first: host the store on a free port and plan the buckets; (address, port, plan)."""
    tensors, dtype, _ = sender_tensors(trainer)
    plan = plan_buckets({n: (dtype or t.dtype, tuple(t.shape)) for n, t in tensors.items()}, bucket_bytes)
    store = TCPStore("0.0.0.0", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False)
    _MEMBERS.setdefault(trainer, {})[group_name] = _Member(store, buckets=plan)
    ray = sys.modules.get("ray")  # a run without Ray (in-process, a GPU node without it) never imports it
    address = ray.util.get_node_ip_address() if ray is not None and ray.is_initialized() else "127.0.0.1"
    return address, store.port, plan


def _join(component, group_name: str, address: str, port: int, rank: int, world_size: int, backend: str,
          timeout_s: float, plan: tuple[Bucket, ...]) -> None:
    """Every member at once (the backend's constructor waits for all of them)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == SENDER:
        member = _member(component, group_name)
    else:
        member = _Member(TCPStore(address, port, None, False, timeout=timeout), buckets=plan)
        _MEMBERS.setdefault(component, {})[group_name] = member
    store = PrefixStore(f"{group_name}/", member.store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        member.backend, member.device = ProcessGroupGloo(store, rank, world_size, timeout), torch.device("cpu")
    elif backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        # The component's own GPU: in-process members join from threads, whose current device is 0.
        device = getattr(component, "device", None)
        member.device = device if device is not None and device.type == "cuda" and device.index is not None \
            else torch.device("cuda", torch.cuda.current_device())
        member.backend = ProcessGroupNCCL(store, rank, world_size, options)
    else:
        raise ValueError(f"weight update group backend {backend!r}: gloo or nccl")


def _send(trainer, group_name: str, check: bool) -> str:
    """Pack and broadcast every bucket, then (check) the digest; returns the digest ("" unchecked)."""
    member = _member(trainer, group_name)
    tensors, dtype, digest = sender_tensors(trainer)
    # Raised before any collective; the engines then fail at the group's timeout.
    check_plan(tensors, dtype, member.buckets)
    hasher = hashlib.sha256() if check and digest is None else None
    buffer = torch.empty(max(b.nbytes for b in member.buckets), dtype=torch.uint8, device=member.device)
    for bucket in member.buckets:
        packed = buffer[: bucket.nbytes]
        pack(packed, bucket, tensors)
        member.broadcast(packed)
        if hasher is not None:  # one host copy per bucket (none on the CPU)
            hash_tensors(hasher, views(packed.cpu(), bucket))
    if not check:
        return ""
    digest = digest if hasher is None else hasher.hexdigest()
    member.broadcast(torch.frombuffer(bytearray(digest.encode()), dtype=torch.uint8).to(member.device))
    return digest


def _receive(engine, group_name: str, check: bool) -> str:
    """Receive every bucket (and the digest), load them with the engine's own update_weights."""
    member = _member(engine, group_name)
    state: dict[str, torch.Tensor] = {}
    for bucket in member.buckets:
        # A buffer per bucket: the state dict's tensors are views of it until update_weights copies them.
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=member.device)
        member.broadcast(buffer)
        state.update(views(buffer, bucket))
    digest = None
    if check:
        received = torch.empty(DIGEST_BYTES, dtype=torch.uint8, device=member.device)
        member.broadcast(received)
        digest = bytes(received.cpu().tolist()).decode()
    return engine.update_weights(state, digest)


def _leave(component, group_name: str) -> None:
    member = _MEMBERS.get(component, {}).pop(group_name, None)
    if member is not None and member.backend is not None:
        member.backend.shutdown()


# ----------------------------------------------------------------------------- the driver
class BroadcastWeightSync:
    """The weight update group of one trainer and its engines (LocalHandle / RayHandle), set up by
    the constructor; `sync()` pushes the trainer's current weights to every engine. A restarted
    actor (RayHandle.restart) has left the group: build a new one (another group_name, or after
    close())."""

    def __init__(self, trainer, engines: list, backend: str = "gloo", bucket_mb: float = 64.0,
                 group_name: str = "miles_weight_update", timeout_s: float = 600.0):
        self.members = [trainer, *engines]
        self.group_name = group_name
        # A thread per member: they block in the same collective, in-process ones included.
        self._pool = ThreadPoolExecutor(max_workers=len(self.members), thread_name_prefix="weight-broadcast")
        address, port, plan = trainer.apply(_listen, group_name, int(bucket_mb * 2**20), timeout_s)
        self.plan = plan  # the buckets every sync sends, in order
        self._all(lambda rank: (_join, group_name, address, port, rank, len(self.members), backend, timeout_s, plan))

    def sync(self, check: bool = True) -> tuple[str, float]:
        """(the trainer's checksum of what it sent, "" unchecked; seconds). With `check` every engine
        verifies what it then holds (a mismatch raises checksum.WeightSyncError)."""
        start = time.perf_counter()
        digest = self._all(lambda rank: (_send if rank == SENDER else _receive, self.group_name, check))[SENDER]
        return digest, time.perf_counter() - start

    def close(self) -> None:
        self._all(lambda rank: (_leave, self.group_name))
        self._pool.shutdown()

    def abandon(self) -> None:
        """A member is gone (restarted): stop the driver's threads; the group's remains stay behind."""
        self._pool.shutdown()

    def _all(self, call_of_rank) -> list:
        """Run `call_of_rank(rank)` = (fn, *args) in every member at once; their results by rank."""
        return results([self._pool.submit(handle.apply, *call_of_rank(rank))
                        for rank, handle in enumerate(self.members)])


def build(components: Components, options: TransportOptions) -> CollectiveTransport:
    """`rollout.weight_sync=broadcast` for the loop: one group of the trainer and every engine,
    set up again (a new group name) after a restart (miles/transport/collective.py)."""
    def setup(trainer, engines: list, generation: int) -> BroadcastWeightSync:
        return BroadcastWeightSync(trainer, engines, options.backend, options.bucket_mb,
                                   group_name=f"miles_weight_update_{generation}", timeout_s=options.timeout_s)

    return CollectiveTransport(TransportName.broadcast, components, setup)
