"""debug.compare_weights_tensorwise: engine and trainer weights compared tensor by tensor, plain and FP8."""

import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, DType, ModelCfg, PrecisionCfg, Quant, RolloutCfg, TrainerCfg
from miles.orchestrate.checkpoints import random_checkpoint
from miles.orchestrate.debug import check_sync_tensors
from miles.orchestrate.handles import LocalHandle
from miles.orchestrate.loop import LoopContext
from miles.orchestrate.sync import sync_weights
from miles.transport.checksum import WeightSyncError
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer

FP8 = PrecisionCfg(name="fp8", train_dtype=DType.bf16, rollout_dtype=DType.bf16, train_quant=Quant.fp8,
                   rollout_quant=Quant.fp8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = ModelCfg(name="t", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, max_position_embeddings=64)
    return str(random_checkpoint(model, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("ck")))


def context(ckpt, precision):
    trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(global_batch_size=8, micro_batch_size=8),
                           precision)
    engine = NativeEngine(ckpt, RolloutCfg(), precision.rollout_dtype, precision=precision)
    return LoopContext(engine=LocalHandle(engine), trainer=LocalHandle(trainer), source=None, tokenizer=None,
                       reward_fn=None, log=None, after_sync=check_sync_tensors)


@pytest.mark.parametrize("precision", [PrecisionCfg(name="fp32"), FP8], ids=["fp32", "fp8"])
def test_a_correct_sync_passes(ckpt, precision):
    ctx = context(ckpt, precision)
    with torch.no_grad():
        next(ctx.trainer.obj.model.parameters()).add_(0.01)  # something to sync
    sync_weights(ctx, check=True)  # the hook runs after the checksum check, and finds nothing


def test_a_wrong_tensor_is_named(ckpt):
    ctx = context(ckpt, PrecisionCfg(name="fp32"))
    sync_weights(ctx, check=False)
    engine_model = ctx.engine.obj.model
    with torch.no_grad():
        engine_model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    with pytest.raises(WeightSyncError, match=r"1 of \d+ tensors differ.*layers\.1\.mlp\.down_proj\.weight"):
        check_sync_tensors(ctx)
