"""The trainer protocol: what the loops and the orchestration call on a trainer, whichever backend it is
(`trainer.backend`): torch (miles/trainer/torch_trainer.py), fsdp (miles/trainer/fsdp.py, its ranks
behind miles/trainer/fsdp_group.py), megatron (miles/trainer/megatron/).

A trainer is a plain class, built in-process or as a Ray actor (miles/orchestrate/handles.py); the
callers go through a handle (`handle.call("train_rl", batch)`), by method name, so nothing type-checks a
call: this protocol states every method and argument a caller passes, and `check_trainer` names what a
class lacks, a method or an argument. The contract suite (tests/trainer_contract.py) calls these methods
as the callers do, against every trainer:

    train_rl(batch)                           the RL loop (miles/orchestrate/loop.py)
    train_sft(batch)                          the SFT loop, the warm start (miles/orchestrate/checkpoints.py)
    kl_to_ref(batch)                          algo.kl_in_reward (miles/orchestrate/returns.py)
    logprobs(batch)                           checks and benchmarks
    get_weights(in_process=...)               weight sync (miles/orchestrate/sync.py), debug.compare_weights_tensorwise
    get_draft_weights()                       sync, with rollout.speculative.kind=draft_model, train_online
    save(path), save_draft(path)              the final checkpoint (miles/orchestrate/run.py), the warm start
    save_state(path), load_state(path)        resume checkpoints (miles/orchestrate/resume.py)
    offload(tags), onload(tags)               colocation (miles/orchestrate/colocate.py)
    offload_bytes()                           colocation's memory report
    device, precision, recipe                 read where the trainer lives (handle.apply: debug checks)

What a backend documents it does not do it refuses when asked, with a message that names the setting
to change (a ValueError or NotImplementedError): an online-trained draft on sharded trainers, offload
on Megatron, in-process weights on FSDP ranks. Validation keeps the loop from asking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles.protocol_check import check_methods

if TYPE_CHECKING:
    import torch

    from miles.types import TrainBatch

TAGS = ("params", "grads", "optimizer")  # what offload / onload act on (miles/trainer/offload.py)


@runtime_checkable
class Trainer(Protocol):
    device: torch.device
    precision: Any  # miles.config.schema.PrecisionCfg
    recipe: Any  # miles.precision.recipe.Recipe: the quantized rollout format weight sync carries

    def train_rl(self, batch: TrainBatch) -> dict[str, float]:
        """`algo.num_steps_per_rollout` optimizer steps of the policy loss on one rollout batch; metrics
        (train/*, mismatch/*, spec/*) are means over the steps. The first step of a rollout has
        train/ppo_kl == 0 and train/pg_clipfrac == 0 exactly (the policy has not moved yet). Ranks of
        one trainer are all called with the same whole batch and return the same metrics."""

    def train_sft(self, batch: TrainBatch) -> dict[str, float]:
        """One NLL optimizer step on the loss-masked targets: {"train/loss", "train/grad_norm", spec/*}."""

    def kl_to_ref(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token KL estimate (algo.kl_estimator) of the policy to the frozen reference, [N, T-1] on
        CPU, 0 off the loss mask (algo.kl_coef > 0 builds the reference)."""

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs of tokens[:, 1:] under the current policy at the loss positions, [N, T-1], 0 elsewhere."""

    def get_weights(self, in_process: bool = False) -> tuple[Any, str]:
        """(what weight sync carries, the checksum the engine must then hold): a state dict in
        precision.rollout_dtype under the project's parameter names on CPU, or the recipe's quantized
        payload. `in_process` (the engine shares this process): a FlatWeights on the trainer's device
        with its device checksum; a backend that cannot share refuses. Ranks: rank 0 returns the
        weights, the others ({}, ""). Refused (RuntimeError naming onload) while params are offloaded."""

    def get_draft_weights(self, in_process: bool = False) -> tuple[dict[str, torch.Tensor], str]:
        """The separately trained draft model's weights (speculative kind draft_model, train_online)
        and their checksum; a trainer without one raises ValueError."""

    def save(self, path: str) -> None:
        """The policy as an HF-format dir (loadable by miles.models.from_pretrained, model.hf_checkpoint)."""

    def save_draft(self, path: str) -> None:
        """The draft model as an HF-format dir; a trainer without one raises ValueError."""

    def save_state(self, path: str) -> None:
        """Everything the trainer needs to continue exactly, into the directory `path` (every rank sees
        it): the policy as an HF-format dir `path/model`, the optimizer state, the draft's, the RNG of
        each process. The frozen KL reference and teacher are rebuilt from their checkpoints."""

    def load_state(self, path: str) -> None:
        """What save_state wrote, into a trainer built with the same arguments (and ranks): its next
        steps are those the saved one would have taken."""

    def offload(self, tags: tuple[str, ...] = TAGS) -> None:
        """Free the device memory of `tags` for the engine's turn (colocation); train_* and get_weights
        refuse until onload. An offloaded tag is skipped."""

    def onload(self, tags: tuple[str, ...] = TAGS) -> None:
        """Bring back what offload moved: training continues bit for bit."""

    def offload_bytes(self) -> dict[str, int]:
        """Device bytes offload would free now, per tag."""


METHODS = ("train_rl", "train_sft", "kl_to_ref", "logprobs", "get_weights", "get_draft_weights", "save",
           "save_draft", "save_state", "load_state", "offload", "onload", "offload_bytes")
ATTRIBUTES = ("device", "precision", "recipe")  # set by the constructor: checked on instances


def check_trainer(cls: type) -> None:
    """Raise TypeError naming the protocol methods `cls` lacks, then the protocol arguments its methods
    do not take as the callers pass them (miles/protocol_check.py)."""
    check_methods(cls, Trainer, METHODS, "a trainer")


def check_trainer_instance(trainer: object) -> None:
    """check_trainer on its class, and the protocol's attributes on the instance."""
    check_trainer(type(trainer))
    missing = [a for a in ATTRIBUTES if not hasattr(trainer, a)]
    if missing:
        raise TypeError(f"{type(trainer).__name__} is not a trainer: its instances lack {', '.join(missing)}")
