"""LoRA weight sync through the run's transport (rollout.weight_sync=object_store), in-process and
through Ray actors (slow): after a training step only the adapters travel, the checked sync passes
(the engine's checksum of the adapters it then holds, computed in its own process), the engine's
samples carry the trainer's log-probs, and a corrupted checksum fails with WeightSyncError."""

from types import SimpleNamespace

import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, LoRACfg, PrecisionCfg, RolloutCfg, TrainerCfg
from miles.data.tokenizer import TokenizerInfo
from miles.orchestrate.handles import spawn
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer
from miles.transport.protocol import TransportName, build_transport
from miles.types import build_train_batch

LORA = LoRACfg(rank=8, alpha=16.0)
PROMPTS, LABELS = ["1+2=", "33+4=", "50+50=", "7+8="], ["3", "37", "100", "15"]


@pytest.fixture(scope="module")
def ray_cluster(ray_connection):
    """The module's local Ray (tests/conftest.py `ray_connection`)."""
    yield


def _batch(samples, pad_id, rewards=None):
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(samples))]) if rewards is None else rewards
    adv = rewards - rewards.mean()
    for s, r in zip(samples, rewards):
        s.reward = float(r)
    return build_train_batch(samples, adv, pad_id)


@pytest.mark.parametrize("use_ray", [False, pytest.param(True, marks=pytest.mark.slow, id="ray")])
def test_adapters_sync_and_the_engine_samples_with_the_trainers_logprobs(ckpt, use_ray, request):
    if use_ray:
        request.getfixturevalue("ray_cluster")
    engine = spawn(NativeEngine, use_ray, ckpt, RolloutCfg(max_new_tokens=5), seed=0, lora=LORA)
    trainer = spawn(TorchTrainer, use_ray, ckpt, AlgoCfg(name=AlgoName.grpo),
                    TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=4, lora=LORA), PrecisionCfg(name="fp32"))
    transport = build_transport(TransportName.object_store, SimpleNamespace(trainer=trainer, engine=engine))
    tok = TokenizerInfo.load(ckpt)
    pad = tok.pad_id if tok.pad_id is not None else 0  # the engine's padding id
    for _ in range(2):  # two steps: the second sync replaces the first's adapters
        samples = engine.call("generate", PROMPTS, LABELS, n=4)
        trainer.call("train_rl", _batch(samples, pad))
        transport.sync(check=True)  # raises WeightSyncError unless the engine holds what was sent
    weights, digest = trainer.call("get_weights")
    assert all(".lora_A." in k or ".lora_B." in k for k in weights)
    samples = engine.call("generate", PROMPTS, LABELS, n=2)
    batch = _batch(samples, pad)
    mask = batch.loss_mask.bool()
    assert (trainer.call("logprobs", batch) - batch.rollout_logprobs)[mask].abs().max().item() < 1e-5
    with pytest.raises(Exception, match="adapters checksum"):  # a WeightSyncError (Ray: wrapped in its error)
        engine.call("update_weights", weights, "0" * 64)
