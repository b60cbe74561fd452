"""How a trainer spreads over processes: the part of a step a backend changes by composition, not by
overriding the trainer's methods (DESIGN rule 10).

    trainer = TorchTrainer(ckpt, algo, cfg, precision)                                  # SingleProcess
    trainer = TorchTrainer(ckpt, algo, cfg, precision, parallel=FSDPSharding(rank, world, addr, port))

TorchTrainer (miles/trainer/torch_trainer.py) holds one `Parallelism` and calls it where the whole
batch and the whole model meet the ranks: sharding the built models, planning this rank's
micro-batches, summing what each rank filled, the grad norm over every shard, moving the models for
offload, and the policy's whole state for weight sync, `save` and `save_state`. `SingleProcess` (here)
is the identity: the whole batch, the whole model, in one process. `FSDPSharding`
(miles/trainer/fsdp.py) is FSDP2 over gloo / NCCL ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from miles.trainer import offload as off

if TYPE_CHECKING:
    from miles.config.schema import AlgoCfg, PrecisionCfg
    from miles.models.lora import LoRA
    from miles.precision.recipe import Recipe
    from miles.trainer.draft import DraftTrainer
    from miles.trainer.packing import MicroBatch
    from miles.types import TrainBatch


class TrainerParts(Protocol):
    """What a Parallelism shards, moves and saves of the trainer that holds it (TorchTrainer), and the
    settings it reads to do so: these names, not the trainer's class, so that the trainer depends on
    this module and not the other way round."""
    model: torch.nn.Module  # the policy
    ref_model: torch.nn.Module | None  # the frozen KL reference (algo.kl_coef > 0)
    teacher: torch.nn.Module | None  # the frozen teacher (on-policy distillation)
    draft: DraftTrainer | None  # the speculative draft's trainer
    lora: LoRA | None  # the adapters (trainer.lora.rank > 0)
    optimizer: torch.optim.Optimizer
    recipe: Recipe
    algo: AlgoCfg
    precision: PrecisionCfg
    device: torch.device


class Parallelism(Protocol):
    # Whether the policy is split across ranks: the online speculative draft trains in one process,
    # on whole weights, so TorchTrainer refuses it then. Data, not a comparison of classes or methods
    # (a Ray actor's class is a wrapper whose methods Ray replaces with its own).
    shards_policy: bool
    in_process_weights: bool  # get_weights(in_process=True) can share the policy with an engine here
    routing_replay: bool  # takes MoE routing replay and engine-routed batches
    writes: bool  # this process returns the weights and writes the files (rank 0)
    name: str  # for messages: "the FSDP trainer"

    def shard_models(self, trainer: TrainerParts) -> None:
        """Shard the trainer's built models in place, before its optimizer takes their parameters."""

    def plan(self, batch: TrainBatch, plan: Callable[[TrainBatch], list[MicroBatch]]) -> list[MicroBatch]:
        """This process's micro-batches of `batch` (indices into the whole batch), `plan` cutting a
        part of it; every rank gets as many (ranks meet in the same collectives)."""

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over the ranks that share this batch (each filled its own rows)."""

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the gradients of `params` to `max_norm` in total; their norm before clipping (all shards)."""

    def move_models(self, models: list[torch.nn.Module], device: torch.device, host: bool) -> None:
        """The models' parameters and buffers to host memory (`host`) or back to `device`."""

    def policy_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The policy's whole state dict under the native names ({} where this process does not write)."""

    def save_policy(self, model: torch.nn.Module, path: str) -> None:
        """The policy as an HF-format dir."""

    def save_state(self, trainer: TrainerParts, path: str) -> None:
        """Resume state into the directory `path` (Trainer.save_state)."""

    def load_state(self, trainer: TrainerParts, path: str) -> None:
        """What save_state wrote."""


class SingleProcess:
    """The whole batch and the whole model in this process: every hook the identity."""

    shards_policy = False
    in_process_weights = True
    routing_replay = True
    writes = True
    name = "the torch trainer"

    def shard_models(self, trainer: TrainerParts) -> None:
        pass

    def plan(self, batch: TrainBatch, plan: Callable[[TrainBatch], list[MicroBatch]]) -> list[MicroBatch]:
        return plan(batch)

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def move_models(self, models: list[torch.nn.Module], device: torch.device, host: bool) -> None:
        for model in models:
            off.move_module(model, device, host)

    def policy_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def save_policy(self, model: torch.nn.Module, path: str) -> None:
        from miles.models import save_pretrained

        save_pretrained(model, path)

    def save_state(self, trainer: TrainerParts, path: str) -> None:
        """`model/` (the HF-format policy, its fp32 master weights) and `trainer.pt`: the optimizer state,
        the draft's (a separate draft model's weights included), the torch RNG of this process. Works
        while offloaded too (it reads the host copies)."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.save_policy(trainer.model, str(out / "model"))
        state: dict = {"torch_rng": torch.get_rng_state(), "optimizer": trainer.optimizer.state_dict()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        if trainer.draft is not None:
            state["draft"] = trainer.draft.state_dict()
        torch.save(state, out / "trainer.pt")

    def load_state(self, trainer: TrainerParts, path: str) -> None:
        """A state without a draft's (the draft enabled since): the draft starts afresh."""
        from miles.models import from_pretrained

        state = torch.load(Path(path) / "trainer.pt", weights_only=True)
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        saved = from_pretrained(Path(path) / "model", dtype=next(trainer.model.parameters()).dtype)
        trainer.model.load_state_dict(saved.state_dict())
        trainer.optimizer.load_state_dict(state["optimizer"])
        if "draft" in state and trainer.draft is not None:
            trainer.draft.load_state_dict(state["draft"])
