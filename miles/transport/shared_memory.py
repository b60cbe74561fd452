"""Weight sync for colocated components: the trainer packs its weights into one shared buffer and
every engine on its node loads from views of it; the bytes never cross Ray's object store.

A trainer and its engines on one node (`rollout.colocate=true`, the usual single-node layout) need no
copy through Ray's object store (miles/transport/object_store.py: a host state dict serialized per
sync) nor a process group (miles/transport/broadcast.py): the trainer writes what `get_weights()`
would return into one buffer that every engine's process maps, and each engine copies from it into
its own weights. Only the layout and the checksum cross the driver.

    sync = SharedMemoryWeightSync(trainer, engines)  # the segment, once (handles: LocalHandle / RayHandle)
    digest, seconds = sync.sync()                    # each step: what get_weights -> update_weights did
    sync.close()

In the RL loop (`build_transport("shared_memory", components)`, set up at the first sync):

    python launch.py rollout.num_engines=2 rollout.weight_sync=shared_memory

How it runs:
- Setup, from the driver: every component reports where it runs (host, Ray node, process, device);
  an engine on another node, or (CUDA) on another GPU, is refused with the key to change. The trainer
  plans the layout, broadcast.py's `plan_buckets` with one bucket: tensors back to back at 16-byte
  aligned offsets in one uint8 buffer, names sorted, whatever their dtypes (float8, packed int4).
- CPU trainer: the buffer is a file on /dev/shm (tmpfs: RAM), created once, sized to the plan and
  reserved with posix_fallocate (a full /dev/shm fails here, with a message, rather than with a
  SIGBUS at the first write), mapped read-write by the trainer. Each engine process maps it read-only
  (an engine cannot write the trainer's bytes). As soon as every engine has mapped it the file is
  unlinked: the memory lives on while a process maps it and the kernel frees it when the last mapping
  goes, so a crash or SIGKILL of any process later leaks nothing. Only a process dying during setup,
  between the file's creation and that unlink, leaves /dev/shm/miles-weights-<trainer pid>-*
  behind (a normal exit removes it). A re-setup (an actor restart) makes a new file.
- CUDA trainer: the buffer is one CUDA uint8 tensor on the trainer's GPU, kept across syncs and
  re-setups. Each engine process gets a CUDA IPC handle of it (torch.multiprocessing.reductions
  .reduce_tensor, one per engine so that torch's IPC reference counts balance) and rebuilds it once;
  the tensor is cached and every sync loads from views of it (a device-to-device copy on one GPU).
  Trainer and engines synchronize their device at the end of their part of a sync, so an engine
  never reads a half-packed buffer and the trainer never repacks under a running copy.
- Engines in the trainer's process (LocalHandle) take the trainer's buffer itself: no file mapping,
  no IPC handle.
- A sync: the trainer packs its current weights (plain recipes: its master weights cast to the
  rollout dtype while copying, on its device, no host state dict; quantized rollouts, FP8 / INT4:
  the bytes of get_weights()'s payload) and, with `check`, hashes what it packed (checksum.checksum's
  SHA-256, or get_weights' checksum for quantized payloads). Then every engine, concurrently, builds
  its state dict as typed views of the buffer and calls its own `update_weights(state_dict, digest)`,
  which copies them into its weights and verifies what it then holds (checksum.WeightSyncError).

Limits:
- One node: the engines must share the trainer's host (set rollout.weight_sync=broadcast or
  object_store otherwise). On CUDA, the trainer's GPU too, seen at the same device index (colocated
  Ray actors with fractional GPUs are); engines on other GPUs: rollout.weight_sync=broadcast.
- Memory: the buffer holds the whole payload once (the rollout-dtype model size), in RAM on the CPU
  (/dev/shm must have room for it: docker's default 64 MB does not) or on the trainer's GPU.
- One trainer process (not FSDP ranks), as broadcast.py. The engine must copy from the views, as
  update_weights does: a tensor it kept would alias the buffer and follow the next pack.
- The trainer packs while no engine reads: syncs are serialized by the driver (`sync()` returns when
  every engine has loaded).
- The CUDA buffer is not part of the trainer's offload: it stays on the GPU while the trainer's
  weights are offloaded (colocation); quantized payloads are built on the host by get_weights and
  then copied into the buffer.
- Linux (/dev/shm, posix_fallocate).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
import socket
import sys
import tempfile
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from miles.transport.checksum import hash_tensors
from miles.transport.broadcast import Bucket, check_plan, pack, plan_buckets, sender_tensors, views
from miles.transport.collective import CollectiveTransport, results
from miles.transport.protocol import Components, TransportName, TransportOptions

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
NAME = "miles_weights"
ROLLOUT_KEY = "rollout.weight_sync"


@dataclass(frozen=True)
class Where:
    """Where a component runs."""
    host: str
    node: str | None  # the Ray node id, when Ray is up
    pid: int
    device: str
    gpu: str | None  # the CUDA device's UUID


@dataclass(frozen=True)
class Segment:
    """What crosses the driver at setup: the trainer's buffer (by file or by IPC handle) and its layout."""
    token: str  # one buffer of the trainer: another buffer, another token
    bucket: Bucket
    trainer: Where
    path: str | None  # CPU: the /dev/shm file (until the engines have mapped it)


# ----------------------------------------------------------------------------- inside each component
@dataclass
class _End:
    """This component's view of one segment: the buffer (trainer: its own; engine: mapped / rebuilt)."""
    buffer: torch.Tensor
    bucket: Bucket
    token: str
    owner: bool = False  # the trainer's end
    path: str | None = None  # the trainer's file, until unlinked
    finalizer: Any = None  # unlinks the file should the trainer's end go before that


# component -> {segment name: end}; keyed by the component (in-process, one process holds all ends).
_ENDS: "weakref.WeakKeyDictionary[Any, dict[str, _End]]" = weakref.WeakKeyDictionary()
# token -> the trainer's buffer, for engines in the trainer's process.
_LOCAL: "weakref.WeakValueDictionary[str, torch.Tensor]" = weakref.WeakValueDictionary()


def _end(component: Any, name: str) -> _End:
    try:
        return _ENDS[component][name]
    except KeyError:
        raise RuntimeError(f"no shared weight segment {name!r} here: SharedMemoryWeightSync sets it up") from None


def buffer_of(component: Any, name: str = NAME) -> torch.Tensor:
    """The segment's bytes as this component sees them (tests and debugging: what the engines read)."""
    return _end(component, name).buffer


def _where(component: Any) -> Where:
    device = torch.device(getattr(component, "device", "cpu"))
    gpu = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        gpu = str(getattr(torch.cuda.get_device_properties(index), "uuid", "")) or None
    node = None
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except ImportError:  # a GPU machine without Ray: processes of this host
        pass
    return Where(socket.gethostname(), node, os.getpid(), str(device), gpu)


def _same_process(a: Where, b: Where) -> bool:
    return (a.host, a.pid) == (b.host, b.pid)


def colocation_problems(trainer: Where, engines: list[Where]) -> list[str]:
    """Why these engines cannot load from the trainer's segment (an empty list: they can)."""
    problems = []
    for i, engine in enumerate(engines):
        same_node = trainer.node == engine.node if trainer.node and engine.node else trainer.host == engine.host
        if not same_node:
            problems.append(f"rollout engine {i} runs on {engine.host} (Ray node {engine.node}), the trainer on "
                            f"{trainer.host} (Ray node {trainer.node}): shared memory reaches one node only; set "
                            f"{ROLLOUT_KEY}=broadcast or {ROLLOUT_KEY}=object_store")
        elif not _same_process(engine, trainer) and trainer.device.startswith("cuda") and \
                (not engine.device.startswith("cuda") or (trainer.gpu and engine.gpu and trainer.gpu != engine.gpu)):
            problems.append(f"rollout engine {i} is on {engine.device} ({engine.gpu}), the trainer on {trainer.device} "
                            f"({trainer.gpu}): CUDA IPC shares the trainer's buffer with engines on its own GPU; set "
                            f"{ROLLOUT_KEY}=broadcast (a GPU per member) or {ROLLOUT_KEY}=object_store")
    return problems


def _create_file(path: str, nbytes: int) -> torch.Tensor:
    """A new /dev/shm file of `nbytes` reserved bytes, mapped read-write, as a uint8 tensor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as error:
            os.unlink(path)
            free = os.statvfs(SHM_DIR)
            raise RuntimeError(
                f"{SHM_DIR} cannot hold the {nbytes / 2**20:.1f} MiB weight segment ({error.strerror}; "
                f"{free.f_bavail * free.f_frsize / 2**20:.1f} MiB free): enlarge it (docker: --shm-size) or set "
                f"{ROLLOUT_KEY}=object_store") from None
        memory = mmap.mmap(fd, nbytes)  # MAP_SHARED, read and write
    finally:
        os.close(fd)
    return torch.frombuffer(memory, dtype=torch.uint8)  # the tensor keeps the mapping alive


def _map_read_only(path: str, nbytes: int) -> torch.Tensor:
    fd = os.open(path, os.O_RDONLY)
    try:
        memory = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # "not writable": intended, the engines only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memory, dtype=torch.uint8)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _create(trainer: Any, name: str, cuda_shares: int) -> tuple[Segment, list]:
    """Trainer, at setup: plan the layout and make (or, CUDA, keep) the buffer; the segment and one
    CUDA IPC handle per engine in another process."""
    from torch.multiprocessing.reductions import reduce_tensor

    tensors, dtype, _ = sender_tensors(trainer)
    (bucket,) = plan_buckets({n: (dtype or t.dtype, tuple(t.shape)) for n, t in tensors.items()}, sys.maxsize)
    where = _where(trainer)
    old = _ENDS.get(trainer, {}).get(name)
    if where.device.startswith("cuda"):
        end = old if old is not None and old.bucket == bucket and old.buffer.is_cuda else None
        if end is None:
            _release(trainer, name)
            end = _End(torch.empty(max(1, bucket.nbytes), dtype=torch.uint8, device=where.device), bucket,
                       f"{where.pid}-{secrets.token_hex(8)}", owner=True)
        shares = [reduce_tensor(end.buffer) for _ in range(cuda_shares)]
    else:
        _release(trainer, name)  # engines still mapping the old file keep it until they re-attach
        token = f"{where.pid}-{secrets.token_hex(8)}"
        path = os.path.join(SHM_DIR, f"miles-weights-{token}")
        end = _End(_create_file(path, max(1, bucket.nbytes)), bucket, token, owner=True, path=path)
        end.finalizer = weakref.finalize(end, _unlink_quietly, path)  # also at interpreter exit
        shares = []
    _ENDS.setdefault(trainer, {})[name] = end
    _LOCAL[end.token] = end.buffer
    return Segment(end.token, bucket, where, end.path), shares


def _attach(engine: Any, name: str, segment: Segment, share: tuple | None) -> None:
    """Engine, at setup: the trainer's buffer itself (same process), its file mapped read-only (CPU),
    or the tensor rebuilt from its CUDA IPC handle; kept for every sync."""
    if (segment.trainer.host, segment.trainer.pid) == (socket.gethostname(), os.getpid()):
        buffer = _LOCAL.get(segment.token)
        if buffer is None:
            raise RuntimeError(f"the trainer's weight segment {segment.token} is gone from this process")
    elif segment.path is not None:
        buffer = _map_read_only(segment.path, max(1, segment.bucket.nbytes))
    else:
        rebuild, args = share
        buffer = rebuild(*args)  # torch reuses an IPC mapping this process already holds
        gpu = str(getattr(torch.cuda.get_device_properties(buffer.device), "uuid", "")) or None
        if segment.trainer.gpu and gpu and gpu != segment.trainer.gpu:
            raise RuntimeError(f"the trainer's weight buffer is on GPU {segment.trainer.gpu}, this process sees "
                               f"{buffer.device} as {gpu}: set {ROLLOUT_KEY}=broadcast or {ROLLOUT_KEY}=object_store")
    _ENDS.setdefault(engine, {})[name] = _End(buffer, segment.bucket, segment.token)


def _unlink(trainer: Any, name: str) -> None:
    """Trainer, once every engine has mapped the file: remove its name (the memory stays mapped)."""
    end = _ENDS.get(trainer, {}).get(name)
    if end is not None and end.path is not None:
        end.finalizer.detach()
        _unlink_quietly(end.path)
        end.path = None


def _pack(trainer: Any, name: str, check: bool) -> str:
    """Trainer, each sync: its current weights into the buffer; the digest of what it packed ("" unchecked)."""
    end = _end(trainer, name)
    tensors, dtype, digest = sender_tensors(trainer)
    check_plan(tensors, dtype, (end.bucket,))
    pack(end.buffer, end.bucket, tensors)
    if end.buffer.is_cuda:
        torch.cuda.synchronize(end.buffer.device)  # the engines' processes read it next
    if not check:
        return ""
    if digest is None:
        hasher = hashlib.sha256()
        hash_tensors(hasher, views(end.buffer.cpu() if end.buffer.is_cuda else end.buffer, end.bucket))
        digest = hasher.hexdigest()
    return digest


def _load(engine: Any, name: str, digest: str | None) -> str:
    """Engine, each sync: load the buffer's views with the engine's own update_weights (verified
    against `digest` when given); the checksum it holds ("" unchecked)."""
    end = _end(engine, name)
    held = engine.update_weights(views(end.buffer, end.bucket), digest or None)  # "": an unchecked pack
    if end.buffer.is_cuda:
        torch.cuda.synchronize(end.buffer.device)  # done reading before the trainer packs again
    return held


def _one_thread(fn, *args):
    """`fn(*args)` on one intra-op thread, restored after: for a sync's steps inside a Ray actor's
    process, where nothing else computes meanwhile. A sync's host copies (a few MB for the default
    model) are memory-bound and take the same ~0.2 ms on one thread; on two, each parallel copy
    waited for the OpenMP team's second thread, which on a 2-core machine busy with other processes
    took up to ~80 ms (median of 30 packs: 80 ms on 2 threads, 2.6 ms on 1; issue 28). Copies and
    SHA-256 give the same bytes on any number of threads."""
    threads = torch.get_num_threads()
    if threads == 1:
        return fn(*args)
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def _pack_alone(trainer: Any, name: str, check: bool) -> str:
    return _one_thread(_pack, trainer, name, check)


def _load_alone(engine: Any, name: str, digest: str | None) -> str:
    return _one_thread(_load, engine, name, digest)


def _release(component: Any, name: str) -> None:
    end = _ENDS.get(component, {}).pop(name, None)
    if end is None:
        return
    if end.owner and _LOCAL.get(end.token) is end.buffer:
        del _LOCAL[end.token]
    if end.path is not None:
        end.finalizer.detach()
        _unlink_quietly(end.path)


# ----------------------------------------------------------------------------- the driver
class SharedMemoryWeightSync:
    """The shared weight segment of one trainer and its engines (LocalHandle / RayHandle), set up by
    the constructor; `sync()` pushes the trainer's current weights to every engine. Raises ValueError
    (naming rollout.weight_sync) when an engine is not on the trainer's node (CUDA: GPU)."""

    def __init__(self, trainer, engines: list, name: str = NAME):
        self.trainer, self.engines, self.name = trainer, list(engines), name
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)), thread_name_prefix="weight-shm")
        trainer_at = trainer.apply(_where)
        engines_at = self._each(lambda i: (_where,))
        if problems := colocation_problems(trainer_at, engines_at):
            self._pool.shutdown()
            raise ValueError("rollout.weight_sync=shared_memory: " + "; ".join(problems))
        remote = [i for i, at in enumerate(engines_at) if not _same_process(at, trainer_at)]
        self.segment, shares = trainer.apply(_create, name, len(remote) if trainer_at.device.startswith("cuda") else 0)
        share_of = dict(zip(remote, shares))
        try:
            self._each(lambda i: (_attach, name, self.segment, share_of.get(i)))
        except BaseException:
            try:  # the attach error is the one to see; a dead engine cannot release
                self.close()
            except Exception:
                pass
            raise
        finally:
            trainer.apply(_unlink, name)  # every engine has it mapped (or failed): no name left to leak
        self.kind = "cuda_ipc" if trainer_at.device.startswith("cuda") else "shared_memory"

    def pack(self, check: bool = True) -> str:
        """The trainer packs its current weights; the digest of what it packed ("" unchecked)."""
        return self.trainer.apply(_pack, self.name, check)

    def load(self, digest: str | None) -> list[str]:
        """Every engine loads the buffer (and verifies `digest` when given); what each holds."""
        return self._each(lambda i: (_load, self.name, digest or None))

    def sync(self, check: bool = True) -> tuple[str, float]:
        """(the trainer's checksum of what it packed, "" unchecked; seconds). With `check` every engine
        verifies what it then holds (a mismatch raises checksum.WeightSyncError)."""
        start = time.perf_counter()
        digest = self._chained(check)
        if digest is None:
            digest = self.pack(check)
            self.load(digest)
        return digest, time.perf_counter() - start

    def _chained(self, check: bool) -> str | None:
        """Ray actors: each engine's load is submitted with the trainer's pack future as its argument,
        so Ray starts it when the pack ends, without a round trip through the driver in between
        (~1-2 ms of a CPU sync of the default model: issue 28). None where a handle is no Ray actor's
        (in-process members), or where the chained calls failed otherwise than by a wrong checksum:
        then the caller syncs again through the handles, whose restarts (the supervisor's) apply."""
        actors = [getattr(handle, "actor", None) for handle in (self.trainer, *self.engines)]
        if any(handle.in_process for handle in (self.trainer, *self.engines)) or \
                not all(hasattr(actor, "__ray_call__") for actor in actors):
            return None
        import ray

        from miles.transport.checksum import WeightSyncError

        try:
            digest = actors[0].__ray_call__.remote(_pack_alone, self.name, check)
            ray.get([actor.__ray_call__.remote(_load_alone, self.name, digest) for actor in actors[1:]])
            return ray.get(digest)
        except WeightSyncError:
            raise
        except Exception:  # e.g. a dead engine: the handles' own calls restart it
            return None

    def close(self) -> None:
        """Engines drop their mappings first (CUDA: the IPC references), then the trainer its buffer."""
        try:
            self._each(lambda i: (_release, self.name))
        finally:
            self.trainer.apply(_release, self.name)
            self._pool.shutdown()

    def abandon(self) -> None:
        """A member is gone (restarted): a dead actor cannot release; the new setup replaces the rest."""
        self._pool.shutdown()

    def _each(self, call_of_engine) -> list:
        """Run `call_of_engine(i)` = (fn, *args) in every engine at once; their results in engine order."""
        return results([self._pool.submit(handle.apply, *call_of_engine(i)) for i, handle in enumerate(self.engines)])


def build(components: Components, options: TransportOptions) -> CollectiveTransport:
    """`rollout.weight_sync=shared_memory` for the loop: the trainer and every engine on one segment,
    set up again after a restart (a new actor has not mapped it; the trainer keeps a CUDA buffer, a
    CPU one is made anew)."""
    return CollectiveTransport(TransportName.shared_memory, components,
                               lambda trainer, engines, generation: SharedMemoryWeightSync(trainer, engines))
