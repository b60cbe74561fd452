"""CUDA IPC weight sync (miles.transport.shared_memory) on one GPU: a trainer packs a real model's
weights into its CUDA buffer, an engine in another process (torch.multiprocessing, spawn) rebuilds
the buffer once from its IPC handle and loads every sync from it, bit for bit; engines in the
trainer's process load from the buffer itself. And the bandwidth of a 1 GiB copy out of a buffer
shared over CUDA IPC (printed; no bound asserted).

Skipped without a GPU (CI); on a GPU machine: `pytest -s tests/gpu/test_cuda_ipc.py` (needs torch
and the miles package; no Ray).
"""

import queue
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from miles.config.schema import AlgoCfg, AlgoName, DType, ModelCfg, PrecisionCfg, Quant, RolloutCfg, TrainerCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.orchestrate.handles import LocalHandle
from miles.transport.checksum import checksum
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer
from miles.transport.shared_memory import (SharedMemoryWeightSync, _attach, _create, _load, _pack, _release,
                                           buffer_of)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SMALL = ModelCfg(name="qwen3_small", hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                 num_kv_heads=4, head_dim=32, max_position_embeddings=256)
NAME = "ipc_test"
TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(random_checkpoint(SMALL, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("ckpt") / "m"))


def precision() -> PrecisionCfg:
    return PrecisionCfg(name="test", train_dtype=DType.bf16, rollout_dtype=DType.bf16, rollout_quant=Quant.none,
                        int4_group_size=32)


def new_trainer(checkpoint) -> TorchTrainer:
    return TorchTrainer(checkpoint, AlgoCfg(name=AlgoName.grpo), TrainerCfg(), precision(), device="cuda")


def new_engine(checkpoint) -> NativeEngine:
    cfg = RolloutCfg(max_new_tokens=4, slot_decode=False, compile=False, cuda_graphs=False)  # no decode here
    return NativeEngine(checkpoint, cfg, DType.bf16, "cuda", seed=0, precision=precision())


@torch.no_grad()
def perturb(trainer: TorchTrainer) -> None:
    """Move every weight by more than a bf16 rounding step: the next sync carries other bytes."""
    for p in trainer.model.parameters():
        p.add_(0.05)


def next_reply(replies, process) -> tuple:
    """The engine process's next reply; fails as soon as the process is gone without one."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            reply = replies.get(timeout=5.0)
        except queue.Empty:
            if not process.is_alive():
                raise AssertionError(f"the engine process exited with code {process.exitcode} and no reply") from None
            continue
        assert reply[0] != "error", reply[1]
        return reply
    raise AssertionError(f"no reply from the engine process in {TIMEOUT_S:.0f} s")


def stop(process, requests) -> None:
    requests.put(None)
    process.join(timeout=60)
    if process.is_alive():
        process.kill()
        process.join()


# ----------------------------------------------------------------------------- the engine's process
def engine_process(checkpoint, segment, share, requests, replies) -> None:
    """Rebuild the trainer's buffer once (then reply "ready"); for every digest sent, load it and
    reply (held checksum, the checksum of the engine's state dict, the buffer's address); None:
    release and stop."""
    try:
        engine = new_engine(checkpoint)
        _attach(engine, NAME, segment, share)
        replies.put(("ready",))
        while (digest := requests.get(timeout=TIMEOUT_S)) is not None:
            held = _load(engine, NAME, digest)
            replies.put(("ok", held, checksum(engine.model.state_dict()), buffer_of(engine, NAME).data_ptr()))
        _release(engine, NAME)  # the IPC reference goes before the trainer frees its buffer
        torch.cuda.synchronize()
        replies.put(("done",))
    except BaseException:
        replies.put(("error", traceback.format_exc()))


def copy_process(share, requests, replies) -> None:
    """Rebuild a shared buffer; for every request, copy all of it into a buffer of this process."""
    try:
        rebuild, args = share
        source = rebuild(*args)
        target = torch.empty_like(source)
        replies.put(("ready",))
        while requests.get(timeout=TIMEOUT_S) is not None:
            torch.cuda.synchronize()
            start = time.perf_counter()
            target.copy_(source)
            torch.cuda.synchronize()
            replies.put(("ok", time.perf_counter() - start, int(target[0]), int(target[-1])))
        del source, target
        torch.cuda.synchronize()
        replies.put(("done",))
    except BaseException:
        replies.put(("error", traceback.format_exc()))


# ----------------------------------------------------------------------------- tests
def test_an_engine_process_loads_the_trainers_weights_over_cuda_ipc(checkpoint):
    trainer = new_trainer(checkpoint)
    segment, shares = _create(trainer, NAME, 1)
    assert segment.path is None and len(shares) == 1  # no file: a CUDA buffer and one IPC handle
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=engine_process, args=(checkpoint, segment, shares[0], requests, replies))
    process.start()
    try:
        assert next_reply(replies, process) == ("ready",)  # built its engine, rebuilt the buffer
        digests, pointers = [], []
        for step in range(2):
            if step:
                perturb(trainer)
            start = time.perf_counter()
            digest = _pack(trainer, NAME, True)
            assert digest == trainer.get_weights()[1]  # what the object store path would have checked
            requests.put(digest)
            _, held, state_checksum, pointer = next_reply(replies, process)
            print(f"\nstep {step}: {segment.bucket.nbytes / 2**20:.1f} MiB over CUDA IPC, checked, "
                  f"{(time.perf_counter() - start) * 1e3:.1f} ms")
            assert held == digest and state_checksum == digest
            digests.append(digest)
            pointers.append(pointer)
        assert digests[0] != digests[1]
        assert pointers[0] == pointers[1]  # rebuilt once, then reused
        requests.put(None)
        assert next_reply(replies, process) == ("done",)
        process.join(timeout=60)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            stop(process, requests)
        _release(trainer, NAME)


def test_engines_in_the_trainers_process_load_from_its_buffer(checkpoint):
    trainer = LocalHandle(new_trainer(checkpoint))
    engines = [LocalHandle(new_engine(checkpoint)) for _ in range(2)]
    sync = SharedMemoryWeightSync(trainer, engines)
    try:
        assert sync.kind == "cuda_ipc" and sync.segment.path is None
        assert all(buffer_of(e.obj) is buffer_of(trainer.obj) for e in engines)  # no IPC in one process
        assert buffer_of(trainer.obj).is_cuda
        perturb(trainer.obj)
        digest, seconds = sync.sync()
        print(f"\nin-process CUDA sync to 2 engines, checked: {seconds * 1e3:.1f} ms")
        assert digest == trainer.call("get_weights")[1]
        assert [checksum(e.obj.model.state_dict()) for e in engines] == [digest, digest]
        perturb(trainer.obj)
        assert sync.sync(check=False)[0] == ""
        assert [checksum(e.obj.model.state_dict()) for e in engines] == [trainer.call("get_weights")[1]] * 2
    finally:
        sync.close()


def test_bandwidth_of_a_1gib_copy_out_of_a_cuda_ipc_buffer():
    from torch.multiprocessing.reductions import reduce_tensor

    nbytes = 2**30
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    weights = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=copy_process, args=(reduce_tensor(buffer), requests, replies))
    process.start()
    try:
        assert next_reply(replies, process) == ("ready",)
        for step in range(4):
            weights.fill_(float(step + 1))
            torch.cuda.synchronize()
            start = time.perf_counter()
            buffer.copy_(weights.view(torch.uint8))  # what the trainer's pack does, for 1 GiB
            torch.cuda.synchronize()
            packed = time.perf_counter() - start
            requests.put(step)
            _, copied, first, last = next_reply(replies, process)
            total = time.perf_counter() - start
            expected = int(torch.tensor([float(step + 1)], dtype=torch.bfloat16).view(torch.uint8)[0])
            assert first == expected and last == int(buffer[-1])  # the engine read this step's bytes
            print(f"\n1 GiB: pack {nbytes / packed / 1e9:.1f} GB/s, engine copy over IPC "
                  f"{nbytes / copied / 1e9:.1f} GB/s, whole sync with the queue round trip {total * 1e3:.1f} ms "
                  f"({nbytes / total / 1e9:.1f} GB/s)")
        requests.put(None)
        assert next_reply(replies, process) == ("done",)
        process.join(timeout=60)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            stop(process, requests)
