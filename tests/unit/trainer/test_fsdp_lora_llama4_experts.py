"""LoRA on Llama 4's transposed stacked experts (trainer.lora.target_modules: [..., experts]) on the FSDP2
trainer: 2 gloo ranks (Ray actors) train the expert adapters the 1-process torch trainer trains on
the same batch (the stacks sharded and frozen, their adapters replicated, gradients summed over the
ranks), and the merged export gathered on rank 0 is the adapted model."""

import pytest
import torch
from grpo_batches import grpo_batch

from miles.config.schema import AlgoCfg, AlgoName, LoRACfg, PrecisionCfg, TrainerCfg
from miles.orchestrate.checkpoints import random_checkpoint
from miles.trainer.fsdp_group import FSDPGroup
from miles.trainer.torch_trainer import TorchTrainer

pytestmark = pytest.mark.slow

FP32 = PrecisionCfg(name="fp32")
WEIGHT_TOL = 1e-5  # as tests/unit/trainer/test_fsdp_lora_experts.py
ALGO = AlgoCfg(name=AlgoName.grpo)
# Plain SGD, whose update is linear in the gradient: with Adam the ranks' 1e-7-relative summation
# differences of the experts' tiny gradients (a transposed pair's output side A gets none in the
# first step, B being zero) are normalised up to 1.9e-5 after two steps, the grad norms still equal.
CFG = TrainerCfg(lr=1.0, global_batch_size=16, micro_batch_size=4,
                 lora=LoRACfg(rank=4, alpha=8.0, target_modules=["q_proj", "experts"]))


@pytest.fixture(scope="module")
def llama4_ckpt(tmp_path_factory, compose):
    model = compose(["model=llama4_tiny"]).model
    return str(random_checkpoint(model, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("llama4")))


@pytest.fixture(scope="module")
def local_ray(ray_connection):
    yield


def test_two_ranks_train_the_llama4_expert_adapters_of_one_process(llama4_ckpt, local_ray, tmp_path):
    batch = grpo_batch(llama4_ckpt)
    one = TorchTrainer(llama4_ckpt, ALGO, CFG, FP32, threads=1, optimizer="sgd")
    assert any(".experts." in name for name in one.lora.names)
    n_metrics = [one.train_rl(batch) for _ in range(2)]
    n_weights, _ = one.get_weights()
    n_logp = one.logprobs(batch)
    group = FSDPGroup(2, llama4_ckpt, ALGO, CFG, FP32, threads=1, optimizer="sgd")
    try:
        g_metrics = [group.call("train_rl", batch) for _ in range(2)]
        g_weights, _ = group.call("get_weights")
        group.call("save", str(tmp_path / "final"))
    finally:
        group.shutdown()
    for g, n in zip(g_metrics, n_metrics, strict=True):
        assert abs(g["train/grad_norm"] - n["train/grad_norm"]) <= 1e-5 * n["train/grad_norm"]
    experts = [k for k in n_weights if ".experts." in k]
    assert experts and all(float(n_weights[k].abs().max()) > 0 for k in experts)
    assert max(float((g_weights[k] - n_weights[k]).abs().max()) for k in n_weights) <= WEIGHT_TOL
    merged = TorchTrainer(str(tmp_path / "final"), ALGO, TrainerCfg(global_batch_size=16, micro_batch_size=4), FP32)
    torch.testing.assert_close(merged.logprobs(batch), n_logp, atol=1e-5, rtol=0)
