"""What the weight-sync transport tests share: a tiny model's trainer and engines, one training step,
greedy outputs, and the object-store load each transport is compared with."""

from pathlib import Path

import torch

from miles.config.schema import AlgoCfg, AlgoName, DType, PrecisionCfg, Quant, RolloutCfg, TrainerCfg
from miles.orchestrate.handles import LocalHandle
from miles.rollout.native import NativeEngine
from miles.types import build_train_batch

MODEL = Path(__file__).resolve().parents[3] / "conf" / "model" / "qwen3_tiny.yaml"
PROMPTS = ["1+2=", "35+47=", "9*9=", "(12-3)*4="]



class RestartableHandle(LocalHandle):
    """A LocalHandle that restarts as a RayHandle does: a fresh component from the same arguments
    behind the same handle, seen by `actor` (what a collective compares to detect restarts)."""

    def __init__(self, cls, *args, **kwargs):
        self._build = lambda: cls(*args, **kwargs)
        super().__init__(self._build())

    @property
    def actor(self):
        return self.obj

    def restart(self) -> None:
        self.obj = self._build()

def precision(dtype: DType, quant: Quant = Quant.none) -> PrecisionCfg:
    return PrecisionCfg(name="test", train_dtype=DType.bf16, rollout_dtype=dtype, rollout_quant=quant,
                        int4_group_size=32)


def trainer_args(ckpt, dtype, quant=Quant.none):
    # A large learning rate: one step moves every weight by more than a bf16 rounding step.
    return ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(lr=1e-2), precision(dtype, quant)


def engine_args(ckpt, dtype, quant=Quant.none):
    return ckpt, RolloutCfg(max_new_tokens=6), dtype, "cpu", 1, 0, precision(dtype, quant)


def sft_step(trainer, reference: NativeEngine) -> None:
    """One optimizer step on the reference engine's samples: every weight of the trainer changes."""
    samples = reference.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=1.0)
    trainer.call("train_sft", build_train_batch(samples, torch.zeros(len(samples)), reference.pad_id))


def greedy(engine) -> list[tuple[list[int], list[float]]]:
    samples = engine.call("generate", PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)
    return [(s.response_ids, s.rollout_logprobs) for s in samples]


def load_through_object_store(engine: NativeEngine, trainer) -> None:
    """The object-store path that broadcast and shared memory replace: get_weights' host state dict and checksum, then update_weights."""
    weights, digest = trainer.call("get_weights")
    engine.update_weights(weights, digest)
