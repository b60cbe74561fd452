"""Weight sync through one shared segment (miles.transport.shared_memory): a TorchTrainer and two
NativeEngines, in-process and as Ray actors on this node. After a training step every engine holds,
bit for bit, what get_weights would have sent it through the object store, and generates what an
engine loaded that way generates; a corrupted segment fails the check; nothing is left on /dev/shm."""

import gc
import glob
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles.config.schema import DType, Quant
from miles.orchestrate.handles import LocalHandle
from miles.transport.checksum import WeightSyncError, checksum
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer
from miles.transport.protocol import build_transport
from miles.transport.shared_memory import (SHM_DIR, SharedMemoryWeightSync, Where, _create, _release, buffer_of,
                                           colocation_problems)
from sync_cases import engine_args, greedy, load_through_object_store, sft_step, trainer_args



# Run where the component lives; lambdas, so that Ray pickles them by value (this module is no package).
engine_checksum = lambda engine: checksum(engine.model.state_dict())  # noqa: E731
pid_of = lambda component: os.getpid()  # noqa: E731
# Flip the sign bit of a byte of the trainer's segment: after pack, before the engines load.
flip_byte = lambda trainer, at: buffer_of(trainer)[at].bitwise_xor_(0x80)  # noqa: E731


def sign_byte(bucket) -> int:
    """The byte holding the sign of the segment's first tensor's first element (little-endian): a
    flip survives any cast the engine makes (fp32 -> bf16 included)."""
    slot = bucket.slots[0]
    return slot.offset + getattr(torch, slot.dtype).itemsize - 1


def mappings(pid: int | str, path_part: str) -> list[str]:
    """The lines of a process's memory map that name `path_part`."""
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if path_part in line]


# ----------------------------------------------------------------------------- in-process
def in_process(ckpt, dtype, quant=Quant.none):
    trainer = LocalHandle(TorchTrainer(*trainer_args(ckpt, dtype, quant), threads=1))
    engines = [LocalHandle(NativeEngine(*engine_args(ckpt, dtype, quant))) for _ in range(2)]
    return trainer, engines, NativeEngine(*engine_args(ckpt, dtype, quant))


@pytest.mark.parametrize("dtype", [DType.bf16, DType.fp32], ids=str)
def test_every_engine_holds_the_trainers_weights(ckpt, dtype):
    trainer, engines, reference = in_process(ckpt, dtype)
    sync = SharedMemoryWeightSync(trainer, engines)
    assert sync.kind == "shared_memory"
    state = trainer.obj.model.state_dict()
    assert [s.name for s in sync.segment.bucket.slots] == sorted(state)  # one bucket: every tensor
    assert {s.dtype for s in sync.segment.bucket.slots} == {"float32" if dtype == DType.fp32 else "bfloat16"}
    before = greedy(engines[0])
    for step in range(2):  # the segment is set up once and serves every step
        sft_step(trainer, reference)
        expected = trainer.call("get_weights")[1]
        assert engine_checksum(engines[0].obj) != expected
        digest, seconds = sync.sync()
        assert digest == expected and seconds > 0
        assert [engine_checksum(e.obj) for e in engines] == [expected, expected]
    # In-process engines read the trainer's own buffer.
    assert all(buffer_of(e.obj) is buffer_of(trainer.obj) for e in engines)
    load_through_object_store(reference, trainer)
    after = greedy(engines[1])
    assert after == greedy(LocalHandle(reference)) and after != before
    sync.close()


def test_unchecked_sync_loads_the_same_weights(ckpt):
    trainer, engines, reference = in_process(ckpt, DType.bf16)
    sync = SharedMemoryWeightSync(trainer, engines)
    sft_step(trainer, reference)
    assert sync.sync(check=False)[0] == ""
    assert engine_checksum(engines[1].obj) == trainer.call("get_weights")[1]
    sync.close()


@pytest.mark.parametrize("quant", [Quant.fp8, Quant.int4], ids=str)
def test_quantized_rollout_payloads_cross_as_bytes(ckpt, quant):
    """float8 weights, packed int4 (uint8), int64 shapes and fp32 scales in the one segment."""
    trainer, engines, reference = in_process(ckpt, DType.bf16, quant)
    sync = SharedMemoryWeightSync(trainer, engines)
    sent = {s.dtype for s in sync.segment.bucket.slots}
    assert ("float8_e4m3fn" if quant == Quant.fp8 else "uint8") in sent and "float32" in sent
    sft_step(trainer, reference)
    digest, _ = sync.sync()
    assert digest == trainer.call("get_weights")[1]
    assert [e.obj.recipe.held_checksum(e.obj.model) for e in engines] == [digest, digest]
    load_through_object_store(reference, trainer)
    assert greedy(engines[0]) == greedy(LocalHandle(reference))
    sync.close()


@pytest.mark.parametrize("quant", [Quant.none, Quant.fp8], ids=str)
def test_a_corrupted_segment_or_a_wrong_digest_fails_the_check(ckpt, quant):
    trainer, engines, reference = in_process(ckpt, DType.bf16, quant)
    sync = SharedMemoryWeightSync(trainer, engines)
    sft_step(trainer, reference)
    digest = sync.pack(check=True)
    flip_byte(trainer.obj, sign_byte(sync.segment.bucket))
    with pytest.raises(WeightSyncError, match="checksum"):
        sync.load(digest)
    digest = sync.pack(check=True)  # packed again: the segment is whole
    with pytest.raises(WeightSyncError, match="checksum"):
        sync.load("0" * 64)
    assert sync.load(digest) == [digest, digest]
    sync.close()


def test_the_file_is_unlinked_once_mapped_and_close_releases_the_memory(ckpt):
    trainer, engines, reference = in_process(ckpt, DType.bf16)
    # The file exists from its creation until the engines have mapped it, then only as a mapping.
    segment, _ = _create(trainer.obj, "unit", 0)
    assert os.path.exists(segment.path) and os.path.dirname(segment.path) == SHM_DIR
    assert os.path.getsize(segment.path) == segment.bucket.nbytes
    _release(trainer.obj, "unit")
    assert not os.path.exists(segment.path)

    sync = SharedMemoryWeightSync(trainer, engines)
    path = sync.segment.path
    assert not os.path.exists(path)
    assert [line.endswith("(deleted)") for line in mappings("self", path)] == [True]
    sft_step(trainer, reference)
    assert sync.sync()[0] == engine_checksum(engines[0].obj)  # the unlinked segment still serves
    sync.close()
    gc.collect()
    assert mappings("self", path) == [] and not glob.glob(f"{path}*")
    with pytest.raises(RuntimeError, match="no shared weight segment"):
        sync.pack()


def test_engines_off_the_trainers_node_or_gpu_are_refused_with_the_key_to_change():
    cpu = Where("node-a", "ray-a", 1, "cpu", None)
    gpu = Where("node-a", "ray-a", 1, "cuda:0", "GPU-0")
    assert colocation_problems(cpu, [Where("node-a", "ray-a", 2, "cpu", None),
                                     Where("node-a", None, 3, "cuda:0", "GPU-1")]) == []
    [other_node] = colocation_problems(cpu, [Where("node-b", "ray-b", 2, "cpu", None)])
    assert "rollout.weight_sync=broadcast" in other_node and "rollout.weight_sync=object_store" in other_node
    assert colocation_problems(cpu, [Where("node-a", "ray-b", 2, "cpu", None)])  # one host name, two Ray nodes
    assert colocation_problems(gpu, [Where("node-a", "ray-a", 2, "cuda:0", "GPU-0"),
                                     Where("node-a", "ray-a", 1, "cpu", None)]) == []  # its GPU; its process
    problems = colocation_problems(gpu, [Where("node-a", "ray-a", 2, "cuda:0", "GPU-1"),
                                         Where("node-a", "ray-a", 3, "cpu", None)])
    assert len(problems) == 2 and all("CUDA IPC" in p and "rollout.weight_sync=" in p for p in problems)


# ----------------------------------------------------------------------------- Ray actors
@pytest.fixture(scope="module")
def ray_cluster(ray_connection):
    """The module's local Ray (tests/conftest.py `ray_connection`, 4 CPUs: one each for the trainer and
    two engines)."""
    yield


@pytest.mark.slow
def test_ray_actors_on_one_node_sync_through_one_segment(ckpt, ray_cluster):
    import ray

    from miles.orchestrate.handles import spawn
    from miles.rollout.router import EngineFleet

    dtype = DType.bf16
    trainer = spawn(TorchTrainer, True, *trainer_args(ckpt, dtype), threads=1)
    engines = [spawn(NativeEngine, True, *engine_args(ckpt, dtype)) for _ in range(2)]
    reference = NativeEngine(*engine_args(ckpt, dtype))
    loop = build_transport("shared_memory", SimpleNamespace(trainer=trainer, engine=EngineFleet(engines)))
    try:
        before = greedy(engines[0])
        sft_step(trainer, reference)
        expected = trainer.call("get_weights")[1]
        seconds = loop.sync(check=True)
        print(f"\nshared memory sync of {loop.group.segment.bucket.nbytes / 2**20:.2f} MiB to 2 Ray engines: "
              f"{seconds * 1e3:.1f} ms")
        assert [e.apply(engine_checksum) for e in engines] == [expected, expected]
        # Each engine maps the trainer's segment read-only; its name is already gone from /dev/shm.
        path = loop.group.segment.path
        assert not os.path.exists(path) and not glob.glob(f"{SHM_DIR}/miles-weights-{trainer.apply(pid_of)}-*")
        for engine in engines:
            [line] = mappings(engine.apply(pid_of), path)
            assert line.split()[1] == "r--s" and line.endswith("(deleted)")

        # Corrupted between the trainer's pack and the engines' load (in the trainer's process).
        digest = loop.group.pack(check=True)
        trainer.apply(flip_byte, sign_byte(loop.group.segment.bucket))
        with pytest.raises(WeightSyncError, match="checksum"):
            loop.group.load(digest)

        # A restarted engine: the next sync sets the segment up again and reaches it.
        engines[1].restart()
        sft_step(trainer, reference)
        expected = trainer.call("get_weights")[1]
        loop.sync(check=True)
        assert loop.setups == 2 and [e.apply(engine_checksum) for e in engines] == [expected, expected]
        assert mappings(engines[0].apply(pid_of), path) == []  # the old segment left the engine
        load_through_object_store(reference, trainer)
        after = greedy(engines[1])
        assert after == greedy(LocalHandle(reference)) and after != before

        new_path = loop.group.segment.path
        loop.close()
        assert all(mappings(e.apply(pid_of), new_path) == [] for e in engines)
    finally:
        for handle in [trainer, *engines]:
            ray.kill(handle.actor)
