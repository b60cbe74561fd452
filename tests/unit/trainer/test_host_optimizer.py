"""trainer.offload_optimizer (miles/trainer/host_optimizer.py) on the CPU: the optimizer state streamed
through the device bucket by bucket gives the resident step's parameters and state bit for bit, over
several steps, after a resume and with colocation offload on top.

On the CPU host and device memory are one; `offload.FORCE_COPY` makes every move a fresh copy, so the
re-pointing the GPU does (state to the device and back, per bucket) runs here. The device figures
(an 80 GB GPU training the 4B shape) are in docs/benchmarks.md."""

import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, PrecisionCfg, TrainerCfg
from miles.trainer import host_optimizer
from miles.trainer import offload as off
from miles.trainer.torch_trainer import TorchTrainer
from test_offload import assert_bitwise, state_of

BF16 = PrecisionCfg(name="bf16")
CFG = TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=8, weight_decay=0.1)
ALGO = AlgoCfg(name=AlgoName.grpo)


@pytest.fixture(autouse=True)
def copies_and_small_buckets(monkeypatch):
    monkeypatch.setattr(off, "FORCE_COPY", True)
    monkeypatch.setattr(host_optimizer, "BUCKET_BYTES", 4096)  # several buckets on the tiny model


def trainers(ckpt, cfg=CFG):
    return TorchTrainer(ckpt, ALGO, cfg, BF16), TorchTrainer(ckpt, ALGO, TrainerCfg(**{**vars(cfg),
                                                                                        "offload_optimizer": True}), BF16)


def test_the_streamed_step_is_bitwise_the_resident_step(ckpt, rollout_batch):
    resident, streamed = trainers(ckpt)
    assert resident.host_state is None and streamed.host_state is not None
    for _ in range(3):
        assert streamed.train_rl(rollout_batch) == resident.train_rl(rollout_batch)
    with_grad = [p for p in streamed.model.parameters() if p.grad is not None]
    assert len(streamed.host_state._buckets()) > 2 and sum(len(b) for _, b in streamed.host_state._buckets()) \
        == len(with_grad)
    assert_bitwise(state_of(streamed), state_of(resident))
    assert streamed.optimizer.param_groups[0]["params"] == list(streamed.model.parameters())  # groups restored
    assert streamed.optimizer.param_groups[0]["weight_decay"] == 0.1


def test_resume_and_colocation_offload_keep_it_bitwise(ckpt, rollout_batch, tmp_path):
    resident, streamed = trainers(ckpt)
    streamed.train_rl(rollout_batch)
    streamed.save_state(str(tmp_path / "s"))
    again = TorchTrainer(ckpt, ALGO, TrainerCfg(**{**vars(CFG), "offload_optimizer": True}), BF16)
    again.load_state(str(tmp_path / "s"))
    again.offload()  # colocation on top: the optimizer state is in host memory already
    again.onload()
    resident.train_rl(rollout_batch)
    assert again.train_rl(rollout_batch) == resident.train_rl(rollout_batch)
    assert_bitwise(state_of(again), state_of(resident))


def test_sharded_trainers_refuse_it(ckpt):
    from miles.trainer.torch_trainer import TorchTrainer as T

    trainer = T.__new__(T)  # the check reads the parallelism only: no ranks needed to see the refusal
    with pytest.raises(ValueError, match="set trainer.offload_optimizer=false"):
        T.__init__(trainer, ckpt, ALGO, TrainerCfg(**{**vars(CFG), "offload_optimizer": True}), BF16,
                   parallel=_Sharded())


class _Sharded:
    name, shards_policy = "FSDP2 over 2 ranks", True

    def shard_models(self, trainer):
        pass
