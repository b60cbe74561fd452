"""The trainer protocol's contract suite (tests/trainer_contract.py) on CUDA: the native torch trainer on the
GPU, and the Megatron-core trainer (trainer=megatron), in-process, against the torch trainer on the same
GPU. Skipped without CUDA; Megatron without megatron-core (pip install -e '.[megatron]'). On the GPU
machine: `pytest tests/gpu/test_trainer_contract_cuda.py`. The CPU tiers run the same suite for torch and
FSDP (tests/unit/trainer/test_trainer_contract.py, tests/integration/test_trainer_contract_ray.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the suite module
pytest.register_assert_rewrite("trainer_contract")

from trainer_contract import *  # noqa: E402,F401,F403  (the suite's tests and fixtures)
from trainer_contract import Contract  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
HAS_MEGATRON = (importlib.util.find_spec("megatron") is not None
                and importlib.util.find_spec("megatron.core") is not None)


@pytest.fixture(scope="module", params=["torch-cuda", "megatron"])
def contract(request, ckpt):
    from miles.orchestrate.handles import LocalHandle
    from miles.trainer.torch_trainer import TorchTrainer

    if request.param == "torch-cuda":
        def build(algo, cfg, precision, **kwargs):
            return LocalHandle(TorchTrainer(ckpt, algo, cfg, precision, device="cuda", threads=1, **kwargs))

        return Contract("torch-cuda", ckpt, build, TorchTrainer, device="cuda")
    if not HAS_MEGATRON:
        pytest.skip("needs megatron-core (pip install -e '.[megatron]')")
    from miles.trainer.megatron.trainer import MegatronTrainer

    def build_megatron(algo, cfg, precision, **kwargs):
        return LocalHandle(MegatronTrainer(ckpt, algo, cfg, precision, device="cuda", threads=1, **kwargs))

    # Megatron's own Adam (fp32 main parameters), its grad buffers and norm, padded micro-batches:
    # other reduction orders than the torch trainer's.
    return Contract("megatron", ckpt, build_megatron, MegatronTrainer, device="cuda", tol=1e-4, drafts=False)
