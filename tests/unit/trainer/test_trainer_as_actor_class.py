"""The trainer's own checks hold for the class a Ray worker builds, not only for the class itself.

In a Ray actor the instance's class is a subclass (miles.transport.ray_tensors.with_tensor_transport,
then Ray's modified class) whose methods Ray has replaced by wrappers of them (its tracing hook sets
one on the class for every method, whether tracing is on or not). A check that compares classes or
methods (`type(self)._shard_models is TorchTrainer._shard_models`, before the sharding became a
Parallelism the trainer holds) then fails for the plain
TorchTrainer: issue 25, item 4, where every `rollout.speculative.train_online=true` run with Ray on
exited 1. These tests build that class without starting Ray; the integration tier
(tests/integration/test_speculative_runs.py, the `ray` variants) runs the real actors.
"""

import functools
import inspect

import pytest

from miles.config.schema import AlgoCfg, AlgoName, PrecisionCfg, SpeculativeCfg, TrainerCfg
from miles.transport.ray_tensors import with_tensor_transport
from miles.trainer.torch_trainer import TorchTrainer

FP32 = PrecisionCfg(name="fp32")
CFG = TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=4)
GRPO = AlgoCfg(name=AlgoName.grpo)
DRAFT = SpeculativeCfg(kind="draft_model", lr=1e-2)


def as_actor_class(cls: type) -> type:
    """`cls` as a Ray worker holds it: spawn()'s subclass, every method replaced by a wrapper."""
    def wrap(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            return method(self, *args, **kwargs)
        return wrapper

    actor_cls = with_tensor_transport(cls)
    for name, method in inspect.getmembers(actor_cls, inspect.isfunction):
        if name != "__del__":
            setattr(actor_cls, name, wrap(method))
    return actor_cls


def test_the_plain_trainer_trains_a_draft_as_an_actor_class(ckpt, draft_ckpt):
    actor_cls = as_actor_class(TorchTrainer)
    assert actor_cls.train_rl is not TorchTrainer.train_rl  # what broke the identity check (issue 25)
    trainer = actor_cls(ckpt, GRPO, CFG, FP32, speculative=DRAFT, draft_dir=draft_ckpt)
    assert not trainer.parallel.shards_policy and trainer.draft is not None and trainer.draft.kind == "draft_model"


def test_the_fsdp_trainer_still_refuses_an_online_draft_as_an_actor_class(ckpt, draft_ckpt):
    import torch.distributed as dist

    from miles.trainer.fsdp import FSDPTrainer

    with pytest.raises(ValueError, match="the FSDP trainer shards the policy across ranks"):
        as_actor_class(FSDPTrainer)(0, 1, "127.0.0.1", 1, ckpt, GRPO, CFG, FP32, speculative=DRAFT,
                                    draft_dir=draft_ckpt)
    assert not dist.is_initialized()
