"""Weight sync by broadcast (miles.transport.broadcast): a TorchTrainer and two NativeEngines in one
gloo group, in-process (members in threads) and as Ray actors. After a training step every engine
holds, bit for bit, what get_weights would have sent it through the object store, and generates
what an engine loaded that way generates."""

import pytest
import torch
import torch.distributed as dist

from miles.config.schema import DType, Quant
from miles.orchestrate.handles import LocalHandle
from miles.transport.checksum import WeightSyncError, checksum
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer
from miles.transport.broadcast import ALIGN, BroadcastWeightSync, plan_buckets, views
from sync_cases import engine_args, greedy, load_through_object_store, sft_step, trainer_args

SMALL_MB = 1 / 1024  # 1 KiB: below every weight matrix of the tiny model, so a bucket per tensor
LARGE_MB = 1024.0  # every tensor in one bucket


# Run where the engine lives; a lambda, so that Ray pickles it by value (this module is no package).
engine_checksum = lambda engine: checksum(engine.model.state_dict())  # noqa: E731


# ----------------------------------------------------------------------------- the bucket plan
def test_a_bucket_holds_whole_aligned_tensors_and_a_large_tensor_goes_alone():
    tensors = {"a": (torch.bfloat16, (3,)), "b": (torch.float32, (100,)), "c": (torch.float8_e4m3fn, (5,)),
               "d": (torch.float32, ())}
    small = plan_buckets(tensors, bucket_bytes=64)
    assert [[s.name for s in b.slots] for b in small] == [["a"], ["b"], ["c", "d"]]
    assert [(s.offset, s.nbytes) for s in small[2].slots] == [(0, 5), (ALIGN, 4)] and small[2].nbytes == ALIGN + 4
    one = plan_buckets(tensors, bucket_bytes=2**20)
    assert len(one) == 1 and [(s.offset, s.nbytes) for s in one[0].slots] == [(0, 6), (16, 400), (416, 5), (432, 4)]
    # The views cover each tensor's bytes and nothing else: writing all of them fills the buffer's tensor bytes.
    buffer = torch.zeros(one[0].nbytes, dtype=torch.uint8)
    for name, view in views(buffer, one[0]).items():
        assert (view.dtype, tuple(view.shape)) == tensors[name]
        view.reshape(-1).view(torch.uint8).fill_(255)
    assert int(buffer.sum()) == 255 * (6 + 400 + 5 + 4)


# ----------------------------------------------------------------------------- in-process members
def in_process(ckpt, dtype, quant=Quant.none):
    trainer = LocalHandle(TorchTrainer(*trainer_args(ckpt, dtype, quant), threads=1))
    engines = [LocalHandle(NativeEngine(*engine_args(ckpt, dtype, quant))) for _ in range(2)]
    return trainer, engines, NativeEngine(*engine_args(ckpt, dtype, quant))


@pytest.mark.parametrize("bucket_mb", [SMALL_MB, LARGE_MB], ids=["bucket-per-tensor", "one-bucket"])
@pytest.mark.parametrize("dtype", [DType.bf16, DType.fp32], ids=str)
def test_every_engine_holds_the_trainers_weights(ckpt, dtype, bucket_mb):
    trainer, engines, reference = in_process(ckpt, dtype)
    sync = BroadcastWeightSync(trainer, engines, bucket_mb=bucket_mb)
    largest = max(b.nbytes for b in sync.plan)
    assert len(sync.plan) == 1 if bucket_mb == LARGE_MB else (len(sync.plan) > 1 and largest > bucket_mb * 2**20)
    before = greedy(engines[0])
    for step in range(2):  # the group is set up once and serves every step
        sft_step(trainer, reference)
        expected = trainer.call("get_weights")[1]
        assert engine_checksum(engines[0].obj) != expected
        digest, seconds = sync.sync()
        assert digest == expected and seconds > 0
        assert [engine_checksum(e.obj) for e in engines] == [expected, expected]
    load_through_object_store(reference, trainer)
    after = greedy(engines[1])
    assert after == greedy(LocalHandle(reference)) and after != before
    sync.close()


def test_unchecked_sync_loads_the_same_weights(ckpt):
    trainer, engines, reference = in_process(ckpt, DType.bf16)
    sync = BroadcastWeightSync(trainer, engines, bucket_mb=0.1)
    sft_step(trainer, reference)
    assert sync.sync(check=False)[0] == ""
    assert engine_checksum(engines[1].obj) == trainer.call("get_weights")[1]
    sync.close()


@pytest.mark.parametrize("quant", [Quant.fp8, Quant.int4], ids=str)
def test_quantized_rollout_payloads_cross_as_bytes(ckpt, quant):
    """float8 weights, packed int4 (uint8), int64 shapes and fp32 scales in the same buckets."""
    trainer, engines, reference = in_process(ckpt, DType.bf16, quant)
    sync = BroadcastWeightSync(trainer, engines, bucket_mb=0.01)
    sent = {s.dtype for b in sync.plan for s in b.slots}
    assert ("float8_e4m3fn" if quant == Quant.fp8 else "uint8") in sent and "float32" in sent
    sft_step(trainer, reference)
    digest, _ = sync.sync()
    assert digest == trainer.call("get_weights")[1]
    assert [e.obj.recipe.held_checksum(e.obj.model) for e in engines] == [digest, digest]
    load_through_object_store(reference, trainer)
    assert greedy(engines[0]) == greedy(LocalHandle(reference))
    sync.close()


def test_an_engine_of_another_dtype_fails_the_check(ckpt):
    """The digest is verified: an fp32 engine behind a bf16 rollout loads the bytes (load_state_dict
    casts them) but holds other ones."""
    trainer = LocalHandle(TorchTrainer(*trainer_args(ckpt, DType.bf16), threads=1))
    engines = [LocalHandle(NativeEngine(*engine_args(ckpt, DType.fp32)))]
    sync = BroadcastWeightSync(trainer, engines, bucket_mb=0.1)
    with pytest.raises(WeightSyncError, match="checksum"):
        sync.sync()
    sync.close()


def test_the_group_leaves_an_existing_default_group_alone(ckpt, tmp_path):
    """A trainer rank of an FSDP job already has a default process group: the weight update group
    is created beside it and neither sees the other's collectives."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        trainer, engines, reference = in_process(ckpt, DType.bf16)
        sync = BroadcastWeightSync(trainer, engines, bucket_mb=0.1)
        sft_step(trainer, reference)
        assert sync.sync()[0] == engine_checksum(engines[0].obj)
        assert dist.get_world_size() == 1
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        sync.close()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- Ray actors
@pytest.fixture(scope="module")
def ray_cluster(ray_connection):
    """The module's local Ray (tests/conftest.py `ray_connection`, 4 CPUs: one each for the trainer and
    two engines)."""
    yield


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [DType.bf16, DType.fp32], ids=str)
def test_ray_actors_sync_by_broadcast(ckpt, ray_cluster, dtype):
    import ray

    from miles.orchestrate.handles import spawn

    trainer = spawn(TorchTrainer, True, *trainer_args(ckpt, dtype), threads=1)
    engines = [spawn(NativeEngine, True, *engine_args(ckpt, dtype)) for _ in range(2)]
    reference = NativeEngine(*engine_args(ckpt, dtype))
    try:
        before = greedy(engines[0])
        # Two groups over the same actors: buckets below one tensor, and one bucket for all.
        for bucket_mb, name in [(SMALL_MB, "per_tensor"), (LARGE_MB, "one_bucket")]:
            sync = BroadcastWeightSync(trainer, engines, bucket_mb=bucket_mb, group_name=name)
            sft_step(trainer, reference)
            expected = trainer.call("get_weights")[1]
            digest, seconds = sync.sync()
            print(f"\n{dtype} {len(sync.plan)} buckets: broadcast sync {seconds * 1e3:.1f} ms")
            assert digest == expected
            assert [e.apply(engine_checksum) for e in engines] == [expected, expected]
            sync.close()
        load_through_object_store(reference, trainer)
        after = greedy(engines[1])
        assert after == greedy(LocalHandle(reference)) and after != before
    finally:
        for handle in [trainer, *engines]:
            ray.kill(handle.actor)


def test_an_nccl_member_buffers_on_its_components_own_gpu(monkeypatch):
    """In-process members join from threads, whose current CUDA device is 0: an engine on cuda:3
    must still receive on cuda:3 (NCCL refuses two ranks on one GPU). ProcessGroupNCCL is replaced:
    no CUDA here; the device choice is what is checked."""
    from types import SimpleNamespace

    from miles.transport import broadcast

    class FakeNCCL:
        Options = SimpleNamespace

        def __init__(self, store, rank, world_size, options):
            self.rank = rank

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class Component:  # weakly referenced, as the group's members are
        def __init__(self, device):
            self.device = device

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    engine = Component(torch.device("cuda", 3))
    bare = Component(torch.device("cuda"))  # no index: the thread's current device
    for component, expected in ((engine, torch.device("cuda", 3)), (bare, torch.device("cuda", 0))):
        broadcast._join(component, "g", "127.0.0.1", store.port, 1, 2, "nccl", 5.0, ())
        assert broadcast._member(component, "g").device == expected
