"""QLoRA on the FSDP2 trainer (trainer=fsdp, trainer.lora with precision=fp8 / int4_qat): 2 gloo ranks
(Ray actors) hold the frozen base quantized, its codes and scales sharded between them
(miles/trainer/fsdp_qlora.py), and train the adapters the 1-process QLoRA trainer trains on the
same batch: the same loss, grad norm, adapters and log-probs; each rank holds about half the
quantized base, none of it dense; the merged export and resume match the 1-process trainer's."""

from dataclasses import replace

import pytest
import ray
import torch
from grpo_batches import grpo_batch
from safetensors.torch import load_file

from miles.config.schema import AlgoCfg, AlgoName, DType, LoRACfg, ModelCfg, PrecisionCfg, Quant, TrainerCfg
from miles.models.config import MoEConfig
from miles.models.frozen_experts import FrozenQuantExperts
from miles.orchestrate.checkpoints import random_checkpoint
from miles.precision.qlora import FrozenQuantLinear
from miles.trainer.fsdp_group import FSDPGroup
from miles.trainer.torch_trainer import TorchTrainer

pytestmark = pytest.mark.slow

# Adapters after lr-1e-2 Adam steps: 2 ranks sum gradients in another order than one process (as
# tests/unit/trainer/test_fsdp_lora.py). Adam divides m by sqrt(v): where a second step's gradient
# nearly cancels the first in m, a rounding of the sums moves the update by a share of lr, so a few
# elements may differ by up to ADAM_TOL (2% of lr, as tests/unit/trainer/test_trainer_paths.py; one
# of 16,384 adapter values 3.1e-5 apart after 2 steps on an Intel Xeon, 2026-12-05).
WEIGHT_TOL, ADAM_TOL = 1e-5, 2e-4
ALGO = AlgoCfg(name=AlgoName.grpo)
CFG = TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=2, grad_clip=0.05, lora=LoRACfg(rank=4, alpha=8.0))


def fp32_compute(quant: str) -> PrecisionCfg:
    """fp8 / int4_qat with fp32 compute: the recipes' quantization, the CPU's exact arithmetic."""
    return PrecisionCfg(name={"fp8": "fp8", "int4": "int4_qat"}[quant], train_dtype=DType.fp32,
                        rollout_dtype=DType.fp32, train_quant=Quant(quant), rollout_quant=Quant(quant))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """128 / 256 wide: whole FP8 blocks and INT4 groups, so the quantization is real."""
    model = ModelCfg(name="t", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, max_position_embeddings=64)
    return str(random_checkpoint(model, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("fsdp_qlora")))


@pytest.fixture(scope="module")
def batch(ckpt):
    return grpo_batch(ckpt)


@pytest.fixture(scope="module")
def local_ray(ray_connection):
    yield


# Bytes of each parameter a rank holds (its shard of a sharded one); a lambda, which Ray pickles by value.
LOCAL_BYTES = lambda trainer: {  # noqa: E731
    n: (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
    for n, p in trainer.model.named_parameters()}


def held_quantized(trainer) -> dict[str, int]:
    """The 1-process QLoRA trainer's quantized base: bytes of each held code / scale tensor."""
    return {f"{m_name}.{b_name}": b.numel() * b.element_size() for m_name, m in trainer.model.named_modules()
            if isinstance(m, (FrozenQuantLinear, FrozenQuantExperts)) for b_name, b in m.named_buffers(recurse=False)}


def assert_same_step(g_metrics, n_metrics, g_weights, n_weights):
    for key in ("train/grad_norm", "train/pg_loss"):
        assert abs(g_metrics[key] - n_metrics[key]) <= 1e-5 * abs(n_metrics[key]), key
    assert set(g_weights) == set(n_weights)
    diffs = torch.cat([(g_weights[k] - n_weights[k]).abs().flatten() for k in n_weights])
    assert float(diffs.max()) <= ADAM_TOL and float((diffs > WEIGHT_TOL).float().mean()) <= 1e-3


def one_step_both_ways(ckpt, cfg, precision, batch):
    """One train_rl step of the 1-process trainer and of 2 FSDP ranks on `batch`: (the 1-process
    trainer, its metrics and weights, the ranks' metrics, each rank's held bytes, their weights)."""
    one = TorchTrainer(ckpt, ALGO, cfg, precision, threads=1)
    n_metrics = one.train_rl(batch)
    n_weights, _ = one.get_weights()
    group = FSDPGroup(2, ckpt, ALGO, cfg, precision, threads=1)
    try:
        g_metrics = group.call("train_rl", batch)
        rank_bytes = ray.get([r.apply.remote(LOCAL_BYTES) for r in group.ranks])
        g_weights, _ = group.call("get_weights")
    finally:
        group.shutdown()
    return one, n_metrics, n_weights, g_metrics, rank_bytes, g_weights


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_two_ranks_train_the_adapters_of_one_process(ckpt, batch, local_ray, quant, tmp_path):
    precision = fp32_compute(quant)
    one = TorchTrainer(ckpt, ALGO, CFG, precision, threads=1)
    n_metrics = one.train_rl(batch)
    n_weights, _ = one.get_weights()
    n_logp = one.logprobs(batch)
    one.save(str(tmp_path / "one"))
    group = FSDPGroup(2, ckpt, ALGO, CFG, precision, threads=1)
    try:
        g_metrics = group.call("train_rl", batch)
        # After the step every unit is resharded (an eval-only forward leaves the root gathered).
        rank_bytes = ray.get([r.apply.remote(LOCAL_BYTES) for r in group.ranks])
        g_weights, _ = group.call("get_weights")
        g_logp = group.call("logprobs", batch)
        group.call("save", str(tmp_path / "final"))  # gathered a unit at a time on rank 0, merged there
        group.call("save_state", str(tmp_path / "state"))
        continued = group.call("train_rl", batch)
        c_weights, _ = group.call("get_weights")
    finally:
        group.shutdown()
    assert n_metrics["train/grad_norm"] > CFG.grad_clip  # the clip is in the update
    assert set(n_weights) == set(one.lora.tensors())  # the adapters only travel
    assert_same_step(g_metrics, n_metrics, g_weights, n_weights)
    torch.testing.assert_close(g_logp, n_logp, atol=1e-5, rtol=0)
    # Each rank holds its shard of the codes and scales the 1-process trainer holds, no dense copy.
    codes = held_quantized(one)
    assert set(codes) <= set(rank_bytes[0]) and not any(n.endswith("lora_A.weight") for n in rank_bytes[0])
    assert sum(sum(b[n] for n in codes) for b in rank_bytes) == sum(codes.values())
    assert all(sum(b[n] for n in codes) <= 0.55 * sum(codes.values()) for b in rank_bytes)
    assert sum(b[n] for b in rank_bytes for n in b) == sum(codes.values()) + \
        sum(p.numel() * 4 for p in one.model.parameters())  # the rest: the fp32 kept weights, sharded
    # The merged export (the dequantized base + the adapter) is the 1-process trainer's.
    mine, theirs = load_file(tmp_path / "final/model.safetensors"), load_file(tmp_path / "one/model.safetensors")
    assert set(mine) == set(theirs)
    assert max(float((mine[k] - theirs[k]).abs().max()) for k in mine) <= 1e-6
    # Resume exact: new ranks load the codes back in place and take the step the first ranks took
    # after the save, bit for bit. (Against the 1-process trainer a second step is looser under FP8:
    # its activation quantizer turns the ranks' 1e-6 summation-order differences into rounding flips.)
    group = FSDPGroup(2, ckpt, ALGO, CFG, precision, threads=1)
    try:
        group.call("load_state", str(tmp_path / "state"))
        resumed = group.call("train_rl", batch)
        r_weights, _ = group.call("get_weights")
    finally:
        group.shutdown()
    assert resumed["train/grad_norm"] == continued["train/grad_norm"]
    assert all(torch.equal(r_weights[k], c_weights[k]) for k in c_weights)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """A MoE model whose stacked experts are whole 128-blocks / INT4 groups (as test_qlora_experts.py's)."""
    model = ModelCfg(name="m", family="qwen3_moe", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, max_position_embeddings=64,
                     moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128))
    return str(random_checkpoint(model, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("fsdp_qlora_moe")))


def test_moe_experts_held_quantized_and_adapted_on_two_ranks(moe_ckpt, local_ray):
    """The stacked experts' codes (FrozenQuantExperts) sharded like the projections', their adapters trained."""
    batch = grpo_batch(moe_ckpt)
    cfg = replace(CFG, lora=LoRACfg(rank=4, alpha=8.0, target_modules=["q_proj", "experts"]))
    precision = fp32_compute("int4")
    one, n_metrics, n_weights, g_metrics, rank_bytes, g_weights = one_step_both_ways(moe_ckpt, cfg, precision, batch)
    assert all(isinstance(layer.mlp.experts, FrozenQuantExperts) for layer in one.model.layers)
    assert_same_step(g_metrics, n_metrics, g_weights, n_weights)
    assert any(float(w.abs().max()) > 0 for k, w in n_weights.items() if ".experts." in k and "lora_B" in k)
    codes = {k: v for k, v in held_quantized(one).items() if ".experts." in k}
    assert codes and sum(b[n] for b in rank_bytes for n in codes) == sum(codes.values())
    assert all(sum(b[n] for n in codes) <= 0.55 * sum(codes.values()) for b in rank_bytes)  # E = 4: 2 a rank


def test_kl_reference_held_quantized_on_two_ranks(ckpt, batch, local_ray):
    """algo.kl_coef > 0: the reference (the base model) is held quantized and sharded like the policy's
    base, and its KL term is the 1-process trainer's (its gradient in the adapters' step)."""
    algo = AlgoCfg(name=AlgoName.grpo, kl_coef=0.1)
    precision = fp32_compute("int4")
    one = TorchTrainer(ckpt, algo, CFG, precision, threads=1)
    group = FSDPGroup(2, ckpt, algo, CFG, precision, threads=1)
    try:
        n_steps = [one.train_rl(batch) for _ in range(2)]
        g_steps = [group.call("train_rl", batch) for _ in range(2)]
        g_weights, _ = group.call("get_weights")
    finally:
        group.shutdown()
    assert n_steps[1]["train/kl_ref"] > 0  # the adapters moved the policy off the reference
    assert abs(g_steps[1]["train/kl_ref"] - n_steps[1]["train/kl_ref"]) <= 1e-5 * n_steps[1]["train/kl_ref"]
    assert_same_step(g_steps[1], n_steps[1], g_weights, one.get_weights()[0])


def test_recomputing_ranks_train_the_adapters_of_one_process(ckpt, batch, local_ray):
    """trainer.recompute=true on the ranks (now open to the quantizing recipes): each layer's
    recomputation runs over the gathered codes its forward multiplied; the step is the 1-process
    trainer's (which stores its activations)."""
    precision = fp32_compute("fp8")
    _, n_metrics, n_weights, g_metrics, _, g_weights = one_step_both_ways(ckpt, replace(CFG, recompute=True),
                                                                        precision, batch)
    one = TorchTrainer(ckpt, ALGO, CFG, precision, threads=1)
    stored = one.train_rl(batch)
    assert_same_step(g_metrics, stored, g_weights, one.get_weights()[0])
    assert_same_step(n_metrics, stored, n_weights, one.get_weights()[0])
