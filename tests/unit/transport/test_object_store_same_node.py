"""The object store's same-node path (miles/transport/object_store.py): a whole sync between a native
trainer and one native engine that are Ray actors on one node goes through a shared-memory segment;
the engine then holds, bit for bit, what get_weights would have brought it through the object store,
verified by the same SHA-256, and a payload corrupted on its way in still fails the checked sync.
Anything else (a fleet, components in this process) keeps the object store.

In-process stand-ins for Ray actors (`Actorlike`: a LocalHandle that says it is not in this process)
run every test fast; one test runs real Ray actors (slow)."""

import pytest
import torch

from miles.config.schema import DType, Quant
from miles.orchestrate.handles import LocalHandle
from miles.rollout.native import NativeEngine
from miles.rollout.router import EngineFleet
from miles.trainer.torch_trainer import TorchTrainer
from miles.transport.checksum import WeightSyncError, checksum
from miles.transport.object_store import ObjectStoreTransport
from sync_cases import RestartableHandle, engine_args, sft_step, trainer_args
from transport_contract import CorruptingEngine
from types import SimpleNamespace


class Actorlike(RestartableHandle):
    """A component in this process behind a handle that says it is not (as a Ray actor's): the transport
    takes its Ray paths; the segment is this process's own buffer. Restarts like a RayHandle."""
    in_process = False


held = lambda engine: checksum(engine.model.state_dict())  # noqa: E731


def _run(ckpt, engine_cls=NativeEngine, quant=Quant.none, engines=1):
    trainer = Actorlike(TorchTrainer, *trainer_args(ckpt, DType.bf16, quant), threads=1)
    handles = [Actorlike(engine_cls, *engine_args(ckpt, DType.bf16, quant)) for _ in range(engines)]
    engine = handles[0] if engines == 1 else EngineFleet(handles)
    reference = NativeEngine(*engine_args(ckpt, DType.bf16, quant))
    return trainer, handles, ObjectStoreTransport(SimpleNamespace(trainer=trainer, engine=engine)), reference


@pytest.mark.parametrize("quant", [Quant.none, Quant.fp8], ids=str)
def test_a_sync_goes_through_the_segment_and_the_engine_holds_the_object_stores_weights(ckpt, quant):
    trainer, (engine,), transport, reference = _run(ckpt, quant=quant)
    calls = []
    trainer.obj.get_weights = lambda *a, _orig=trainer.obj.get_weights, **k: calls.append(a) or _orig(*a, **k)
    try:
        for _ in range(2):  # the segment set up by the first sync serves the next
            sft_step(trainer, reference)
            expected_weights, expected = TorchTrainer.get_weights(trainer.obj)
            assert transport.sync(check=True) >= 0
            assert transport._segment, "the same-node segment was not used"
            if quant == Quant.none:
                assert calls == []  # no host state dict: packed from the master weights
                assert held(engine.obj) == expected
            else:
                assert engine.obj.recipe.held_checksum(engine.obj.model) == expected
        # fetch / load (the asynchronous rollout's snapshots) stay in the object store
        sft_step(trainer, reference)
        expected = TorchTrainer.get_weights(trainer.obj)[1]
        transport.load(transport.fetch(), check=True)
        assert (held(engine.obj) if quant == Quant.none else
                engine.obj.recipe.held_checksum(engine.obj.model)) == expected
    finally:
        transport.close()


def test_a_corrupted_payload_still_fails_the_checked_sync(ckpt):
    trainer, (engine,), transport, reference = _run(ckpt, engine_cls=CorruptingEngine)
    try:
        sft_step(trainer, reference)
        with pytest.raises(WeightSyncError, match="checksum"):
            transport.sync(check=True)
        assert transport._segment
    finally:
        transport.close()


def test_a_restarted_engine_is_reached_by_the_next_sync(ckpt):
    trainer, (engine,), transport, reference = _run(ckpt)
    try:
        transport.sync(check=True)
        engine.restart()  # a fresh engine: the checkpoint's weights, not mapped to the segment
        sft_step(trainer, reference)
        transport.sync(check=True)
        assert held(engine.obj) == trainer.obj.get_weights()[1]
    finally:
        transport.close()


def test_a_fleet_or_components_in_this_process_keep_the_object_store(ckpt):
    _, handles, transport, reference = _run(ckpt, engines=2)
    assert transport._same_node_segment() is False  # a fleet: the object store (its restarts reload from it)
    trainer = LocalHandle(TorchTrainer(*trainer_args(ckpt, DType.bf16), threads=1))
    engine = LocalHandle(NativeEngine(*engine_args(ckpt, DType.bf16)))
    transport = ObjectStoreTransport(SimpleNamespace(trainer=trainer, engine=engine))
    transport.sync(check=True)
    assert transport._segment is False  # in-process: the flat device copy


@pytest.mark.slow
def test_ray_actors_on_this_node_sync_through_the_segment(ckpt, ray_connection):
    from miles.orchestrate.handles import spawn

    trainer = spawn(TorchTrainer, True, *trainer_args(ckpt, DType.bf16), threads=2)
    engine = spawn(NativeEngine, True, *engine_args(ckpt, DType.bf16))
    transport = ObjectStoreTransport(SimpleNamespace(trainer=trainer, engine=engine))
    reference = NativeEngine(*engine_args(ckpt, DType.bf16))
    try:
        sft_step(trainer, reference)
        expected = trainer.call("get_weights")[1]
        transport.sync(check=True)
        assert transport._segment and engine.apply(held) == expected
        assert trainer.apply(lambda t: torch.get_num_threads()) == 2  # the sync's one thread was given back
    finally:
        transport.close()


def test_a_ray_syncs_steps_run_on_one_thread_and_restore_the_count():
    from miles.transport.shared_memory import _one_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _one_thread(torch.get_num_threads) == 1
        with pytest.raises(ZeroDivisionError):
            _one_thread(lambda: 1 / 0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
