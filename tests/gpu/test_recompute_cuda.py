"""trainer.recompute under the precision recipes on CUDA: each layer's recomputation in backward runs
on the weights its forward multiplied (w8a8's real FP8 GEMMs through scaled_mm, the w8a16 / INT4
round trips), so a step is the stored-activation step. The CPU tier checks it bit for bit
(tests/unit/trainer/test_trainer_paths.py); here the loss must be equal and the gradients within
the run-to-run spread of CUDA's atomic reductions (embedding backward).

Skipped without a GPU (CI). On a GPU machine: `pytest -s tests/gpu/test_recompute_cuda.py`."""

import pytest
import torch

from miles.config.schema import (AlgoCfg, AlgoName, DType, FP8Scheme, ModelCfg, PrecisionCfg, Quant, RolloutCfg,
                                 TrainerCfg)
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import build_train_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

RECIPES = {
    "fp8_w8a8": PrecisionCfg(name="fp8", train_dtype=DType.bf16, rollout_dtype=DType.bf16, train_quant=Quant.fp8,
                             rollout_quant=Quant.fp8, fp8_scheme=FP8Scheme.w8a8),
    "fp8_w8a16": PrecisionCfg(name="fp8", train_dtype=DType.bf16, rollout_dtype=DType.bf16, train_quant=Quant.fp8,
                              rollout_quant=Quant.fp8, fp8_scheme=FP8Scheme.w8a16),
    "int4_qat": PrecisionCfg(name="int4_qat", train_dtype=DType.bf16, rollout_dtype=DType.bf16,
                             train_quant=Quant.int4, rollout_quant=Quant.int4),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """256 wide: whole FP8 blocks and INT4 groups."""
    model = ModelCfg(name="r", hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=64, max_position_embeddings=128)
    return str(random_checkpoint(model, DEFAULT_ALPHABET, 0, tmp_path_factory.mktemp("recompute")))


@pytest.fixture(scope="module")
def batch(ckpt):
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=16), seed=0)
    samples = engine.generate(["1+2=", "35+47=", "9*9=", "(12-3)*4="], ["3", "82", "81", "36"], n=4)
    return build_train_batch(samples, torch.linspace(-1, 1, len(samples)), engine.pad_id)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recompute_is_the_stored_activation_step(ckpt, batch, recipe):
    def step(recompute: bool):
        cfg = TrainerCfg(lr=1e-3, global_batch_size=16, micro_batch_size=4, recompute=recompute)
        # SGD: the update is linear in the gradient, so the atomics' spread stays at its own size
        trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), cfg, RECIPES[recipe], device="cuda", optimizer="sgd")
        metrics = trainer.train_rl(batch)
        return metrics, {k: p.detach().clone() for k, p in trainer.model.named_parameters()}

    (stored, before), (recomputed, after) = step(False), step(True)
    print(f"\n{recipe}: loss {stored['train/loss']:.8g} / {recomputed['train/loss']:.8g}, grad norm "
          f"{stored['train/grad_norm']:.8g} / {recomputed['train/grad_norm']:.8g}")
    assert stored["train/loss"] == recomputed["train/loss"]
    assert recomputed["train/grad_norm"] == pytest.approx(stored["train/grad_norm"], rel=1e-5)
    assert max(float((before[k] - after[k]).abs().max()) for k in before) <= 1e-5
