"""trainer.offload_optimizer on CUDA (miles/trainer/host_optimizer.py): AdamW's moments live in pinned
host memory, each step streams them through the GPU bucket by bucket, and the parameters and state
come out bit for bit as the resident step's, and the device holds none of the state between steps
(pinned host tensors).

Skipped without a GPU (CI). On a GPU machine: `pytest -s tests/gpu/test_host_optimizer_cuda.py` (-s
prints the state's size, the streamed step's device peak above the trainer's resident tensors, and
the step times of both).
"""

import os
import time

import pytest
import torch

from miles.orchestrate import determinism

os.environ.update(determinism.CUBLAS_ENV)  # the two trainers' GEMMs repeat bit for bit

from miles.config.schema import AlgoCfg, AlgoName, DType, ModelCfg, PrecisionCfg, TrainerCfg  # noqa: E402
from miles.data.tokenizer import DEFAULT_ALPHABET  # noqa: E402
from miles.orchestrate.checkpoints import random_checkpoint  # noqa: E402
from miles.trainer import host_optimizer  # noqa: E402
from miles.trainer.torch_trainer import TorchTrainer  # noqa: E402
from miles.types import Sample, build_train_batch  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# ~93M parameters: 740 MB of AdamW moments, in 64 MB buckets (12 of them)
MID = ModelCfg(name="mid", hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=8,
               head_dim=64, max_position_embeddings=512)
BF16 = PrecisionCfg(name="bf16", train_dtype=DType.bf16, rollout_dtype=DType.bf16)
TRAIN = TrainerCfg(lr=1e-4, global_batch_size=64, micro_batch_size=16, weight_decay=0.1)
MB = 2**20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(random_checkpoint(MID, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("ckpt") / "m"))


def batch():
    """64 samples of 12 prompt + 30 response tokens of the checkpoint's vocabulary."""
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt="", label="", prompt_ids=torch.randint(3, 20, (12,), generator=g).tolist(),
                      response_ids=torch.randint(3, 20, (30,), generator=g).tolist(),
                      rollout_logprobs=[-1.0] * 30, reward=float(i % 3 == 0)) for i in range(64)]
    return build_train_batch(samples, torch.linspace(-1, 1, 64), pad_id=0)


def timed_steps(trainer, b, n=3) -> list[float]:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_rl(b)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def test_streamed_state_is_bitwise_resident_and_off_the_device(checkpoint, monkeypatch):
    monkeypatch.setattr(host_optimizer, "BUCKET_BYTES", 64 * MB)
    resident = TorchTrainer(checkpoint, AlgoCfg(name=AlgoName.grpo), TRAIN, BF16, device="cuda", max_response_len=30)
    b = batch()
    t_resident = timed_steps(resident, b)
    state_bytes = resident.offload_bytes()["optimizer"]
    assert state_bytes > 700 * MB
    streamed = TorchTrainer(checkpoint, AlgoCfg(name=AlgoName.grpo), TrainerCfg(**{**vars(TRAIN), "offload_optimizer": True}),
                            BF16, device="cuda", max_response_len=30)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t_streamed = timed_steps(streamed, b)
    peak = torch.cuda.max_memory_allocated() - base
    assert streamed.offload_bytes()["optimizer"] == 0
    states = [v for s in streamed.optimizer.state.values() for v in s.values()]
    assert states and all(v.device.type == "cpu" and v.is_pinned() for v in states)
    for p, q in zip(resident.model.parameters(), streamed.model.parameters()):
        assert torch.equal(p, q)
        for key, value in resident.optimizer.state[p].items():
            assert torch.equal(value.cpu(), streamed.optimizer.state[q][key]), key
    print(f"\noptimizer state {state_bytes / MB:,.0f} MB; streamed step peak above the trainer's resident "
          f"tensors {peak / MB:,.0f} MB; step s resident {t_resident} streamed {t_streamed}")
    del resident
