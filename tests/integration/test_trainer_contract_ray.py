"""The trainer protocol's contract suite (tests/trainer_contract.py) through Ray actors, as a run with
ray.enabled drives its trainer: the torch trainer in one actor (miles.orchestrate.handles.spawn), and the
FSDP2 trainer as 2 gloo ranks, one actor each (miles/trainer/fsdp_group.py; 1 rank runs in-process
in the unit tier: a 1-rank Ray variant added ~70 s to CI and nothing the 2 ranks miss). What crosses the
object store (batches, weights, metrics) and the class a Ray worker builds are what this tier adds to
the in-process one (tests/unit/trainer/test_trainer_contract.py). 2 ranks: each trains on its share of
the batch, and the reductions over ranks give the 1-rank numbers."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the suite module
pytest.register_assert_rewrite("trainer_contract")

from trainer_contract import *  # noqa: E402,F401,F403  (the suite's tests and fixtures)
from trainer_contract import Contract  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray(ray_connection):
    """The module's local Ray (tests/conftest.py `ray_connection`)."""
    yield


def _kill(handle) -> None:
    import ray

    ray.kill(handle.actor, no_restart=True)


# torch-ray in the extended tier (make test-extended): every Ray run of make test has its torch trainer
# in an actor (test_e2e_ray_mlflow.py, test_fault.py, ...), the draft weights through one included
# (test_speculative_runs.py's draft model resumed with Ray on); FSDP2's 2 rank actors only here.
@pytest.fixture(scope="module", params=[pytest.param("torch-ray", marks=pytest.mark.extended), "fsdp2-ray"])
def contract(request, ckpt, local_ray):
    from miles.orchestrate.handles import spawn
    from miles.trainer.fsdp import FSDPTrainer
    from miles.trainer.fsdp_group import FSDPGroup
    from miles.trainer.torch_trainer import TorchTrainer

    if request.param == "torch-ray":
        def build(algo, cfg, precision, **kwargs):
            return spawn(TorchTrainer, True, ckpt, algo, cfg, precision, threads=1, **kwargs)

        return Contract("torch-ray", ckpt, build, TorchTrainer, close=_kill)

    def build_group(algo, cfg, precision, **kwargs):
        return FSDPGroup(2, ckpt, algo, cfg, precision, threads=1, **kwargs)

    # 2 ranks: other micro-batches per rank and sums in another order than the torch trainer's.
    return Contract(request.param, ckpt, build_group, FSDPTrainer, close=lambda group: group.shutdown(),
                    tol=1e-5, in_process_weights=False, drafts=False)
