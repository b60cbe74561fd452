"""The trainer protocol's contract suite (tests/trainer_contract.py) in-process on the CPU: the native torch
trainer, and the FSDP2 trainer as one gloo rank in this process (its collectives over one rank: the
sharding, the reductions and the rank-0 paths run; the 2-rank split of the batch runs in Ray actors in
tests/integration/test_trainer_contract_ray.py). Megatron runs the suite in
tests/megatron (CPU, `make test`) and on CUDA (tests/gpu/test_trainer_contract_cuda.py)."""

import socket

import pytest

pytest.register_assert_rewrite("trainer_contract")

from trainer_contract import *  # noqa: E402,F401,F403  (the suite's tests and fixtures)
from trainer_contract import Contract, force_copy  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["torch", "fsdp1"])
def contract(request, ckpt):
    from miles.orchestrate.handles import LocalHandle
    from miles.trainer.fsdp import FSDPTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    if request.param == "torch":
        def build(algo, cfg, precision, **kwargs):
            return LocalHandle(TorchTrainer(ckpt, algo, cfg, precision, threads=1, **kwargs))

        yield Contract("torch", ckpt, build, TorchTrainer, moves=force_copy)
        return
    import torch.distributed as dist

    port = _free_port()  # one process group for the module's trainers (a process holds one)

    def build_fsdp(algo, cfg, precision, **kwargs):
        return LocalHandle(FSDPTrainer(0, 1, "127.0.0.1", port, ckpt, algo, cfg, precision, threads=1, **kwargs))

    # One rank: the same micro-batches as the torch trainer, the sums over one rank exact.
    yield Contract("fsdp1", ckpt, build_fsdp, FSDPTrainer, tol=1e-6, in_process_weights=False, drafts=False,
                   moves=force_copy)
    if dist.is_initialized():  # other modules build their own
        dist.destroy_process_group()
