"""The trainer protocol's contract suite (tests/trainer_contract.py) on the Megatron-core trainer, on the CPU
(CUDA mapped to the CPU: tests/megatron/cuda_on_cpu.py), against the torch trainer in the same process.
The same suite runs on the H200 in tests/gpu/test_trainer_contract_cuda.py."""

import pytest

pytest.register_assert_rewrite("trainer_contract")

from trainer_contract import *  # noqa: E402,F401,F403  (the suite's tests and fixtures)
from trainer_contract import Contract, force_copy  # noqa: E402


@pytest.fixture(scope="module")
def contract(ckpt, megatron_on_this_device):
    from miles.orchestrate.handles import LocalHandle
    from miles.trainer.megatron.trainer import MegatronTrainer

    device = megatron_on_this_device

    def build(algo, cfg, precision, **kwargs):
        return LocalHandle(MegatronTrainer(ckpt, algo, cfg, precision, device=device, threads=1, **kwargs))

    # Megatron's own Adam (fp32 main parameters), its grad buffers and norm, padded micro-batches:
    # other reduction orders than the torch trainer's.
    # offload on the CPU: the buffers' storage really goes and comes back; FORCE_COPY moves the Adam moments too
    return Contract("megatron", ckpt, build, MegatronTrainer, device=device, tol=1e-4, drafts=False,
                    moves=force_copy)
