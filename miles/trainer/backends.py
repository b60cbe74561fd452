"""The trainer backends by name: `trainer=<name>` (a `TrainerBackend`) -> what starts its trainer.

    start = TrainerStart(args, kwargs, num_ranks=cfg.trainer.num_ranks,
                         spawn=lambda cls: spawn(cls, use_ray, *args, num_gpus=gpu, **kwargs))
    handle = start_trainer(cfg.trainer.backend, start)   # a handle the loop calls (miles/orchestrate/handles.py)

A one-process backend is one `spawn` of its class, in-process or as a Ray actor; FSDP starts
`trainer.num_ranks` rank actors of its own (miles/trainer/fsdp_group.py). A lazy registry: a backend's
module is imported when its trainer starts (Megatron-core is an optional dependency).

A new backend: its class (the Trainer protocol of miles/trainer/protocol.py, tests/trainer_contract.py),
its name in `TrainerBackend`, its group file, its rules registered in miles/validate.py, and one entry
in STARTERS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from miles.config.schema import TrainerBackend


@dataclass(frozen=True)
class TrainerStart:
    """What every backend starts its trainer from (miles/orchestrate/run.py fills it)."""
    args: tuple  # TorchTrainer's positional arguments: checkpoint dir, algo, trainer cfg, precision, ...
    kwargs: dict
    num_ranks: int
    spawn: Callable[[type], Any]  # cls -> a handle to cls(*args, **kwargs): in-process or one Ray actor


def _torch(start: TrainerStart) -> Any:
    from miles.trainer.torch_trainer import TorchTrainer

    return start.spawn(TorchTrainer)


def _fsdp(start: TrainerStart) -> Any:
    from miles.trainer.fsdp_group import FSDPGroup  # its ranks: Ray actors in a placement group of their own

    return FSDPGroup(start.num_ranks, *start.args, **start.kwargs)


def _megatron(start: TrainerStart) -> Any:
    from miles.trainer.megatron.trainer import MegatronTrainer

    return start.spawn(MegatronTrainer)


STARTERS: dict[TrainerBackend, Callable[[TrainerStart], Any]] = {
    TrainerBackend.torch: _torch,
    TrainerBackend.fsdp: _fsdp,
    TrainerBackend.megatron: _megatron,
}


def start_trainer(backend: TrainerBackend, start: TrainerStart) -> Any:
    return STARTERS[backend](start)
