"""rollout.memory_saver on CUDA: the engine's plain weights and slot cache in torch_memory_saver's
regions. A release gives their device memory back (measured by the driver: the regions are outside
PyTorch's allocator), a resume maps memory at the same addresses, and the decode graphs captured
before the release replay after it, with no capture, giving the samples of an engine never released.

Skipped without a GPU or without torch_memory_saver (CI). On a GPU machine:
`pytest -s tests/gpu/test_memory_saver_cuda.py` (-s prints the release and resume times).
"""

import time
from dataclasses import replace

import pytest
import torch

from miles.config.schema import DType, ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.rollout.slots import DecodeGraphs
from miles.transport.flat import FlatWeights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("torch_memory_saver")

MID = ModelCfg(name="mid", hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=8,
               head_dim=64, max_position_embeddings=512)
ROLLOUT = RolloutCfg(max_new_tokens=40, max_prompt_len=16, max_running=128, sync_every=4, n_samples_per_prompt=4)
PROMPTS = [f"{a}+{b}=" for a, b in zip(range(10, 90, 5), range(33, 99, 4))]  # 16 prompts x 4 = 64 samples


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(random_checkpoint(MID, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("ckpt") / "m"))


def generate(eng):
    out = eng.generate(PROMPTS, ["?"] * len(PROMPTS), n=4, seeds=list(range(len(PROMPTS))))
    return [(s.response_ids, s.rollout_logprobs) for s in out]


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_paused_engine_replays_its_graphs_after_a_resume(checkpoint, monkeypatch):
    eng = NativeEngine(checkpoint, replace(ROLLOUT, memory_saver=True), DType.bf16, device="cuda", seed=0)
    assert eng.slots.captured
    before = generate(eng)
    sync = FlatWeights(eng.flat.layout, eng.flat.buffer.clone())  # what the trainer would send
    held = sum(eng.held_bytes().values())
    addresses = (eng.flat.buffer.data_ptr(), [t.data_ptr() for layer in eng.slots.cache.layers for t in layer.tensors()])
    graphs = dict(eng.slots.graphs.graphs)
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self: pytest.fail("a paused engine captures nothing again"))

    free = free_bytes()
    start = time.perf_counter()
    eng.release_memory(keep_weights=False)
    released_s = time.perf_counter() - start
    freed = free_bytes() - free
    assert freed >= 0.9 * held, (freed, held)  # the weights' and the cache's device memory went back

    start = time.perf_counter()
    eng.resume_memory()
    torch.cuda.synchronize()
    resumed_s = time.perf_counter() - start
    print(f"\nheld {held / 2**20:.0f} MiB, freed {freed / 2**20:.0f} MiB; release {released_s * 1e3:.1f} ms, "
          f"resume {resumed_s * 1e3:.1f} ms (no capture)")
    assert (eng.flat.buffer.data_ptr(),
            [t.data_ptr() for layer in eng.slots.cache.layers for t in layer.tensors()]) == addresses
    assert eng.slots.graphs.graphs == graphs  # the same graph objects
    eng.update_weights(sync, sync.checksum())
    assert generate(eng) == before  # bit for bit: the graphs read the refilled weights and a zeroed cache
