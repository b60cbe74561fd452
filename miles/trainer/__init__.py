"""Trainer backends: `torch_trainer.TorchTrainer` (one process), `fsdp.FSDPTrainer` (FSDP2 ranks, run by
`fsdp_group.FSDPGroup`), `megatron.trainer.MegatronTrainer` (Megatron-core, CUDA).

Every trainer offers the `Trainer` protocol (miles/trainer/protocol.py, checked by `check_trainer` and
the contract suite tests/trainer_contract.py); the loop only calls its methods, through a handle
(miles/orchestrate/handles.py).
"""

from __future__ import annotations

from miles.trainer.protocol import METHODS, Trainer, check_trainer, check_trainer_instance

__all__ = ["METHODS", "Trainer", "check_trainer", "check_trainer_instance"]
