"""The weight transport contract suite (tests/transport_contract.py) against every transport of
`TransportName`: in-process (LocalHandle members, a collective's members in threads), and through Ray
actors on this node (slow: the checked sync and the restart)."""

import pytest

pytest.register_assert_rewrite("transport_contract")

from transport_contract import *  # noqa: E402,F401,F403  (the suite's tests)
from transport_contract import Contract  # noqa: E402
from sync_cases import RestartableHandle  # noqa: E402
from miles.transport.protocol import TransportName  # noqa: E402

NAMES = list(TransportName)
# Only the cases with this word in their id start a Ray (tests/conftest.py: the in-process cases run
# beside the xdist Ray group).
RAY_CASE_ID = "ray"
# Through Ray: (test, its other parameters) of the suite that run there; the rest only in-process.
RAY_TESTS = {("test_a_checked_sync_makes_every_engine_hold_the_trainers_weights", ("plain", 2)),
             ("test_a_checked_sync_makes_every_engine_hold_the_trainers_weights", ("fp8", 2)),
             ("test_a_restarted_engine_is_reached_by_the_next_sync", ()),
             ("test_an_engine_that_dies_before_a_sync_is_restarted_and_that_sync_completes", ())}


def _ray_runs(node) -> bool:
    params = {k: v for k, v in node.callspec.params.items() if k != "contract"}
    return (node.originalname, tuple(params[k] for k in ("recipe", "engines") if k in params)) in RAY_TESTS


def local_contract(name, ckpt) -> Contract:
    return Contract(name, ckpt, spawn=RestartableHandle, restart=lambda handle: handle.restart())


@pytest.fixture(scope="module")
def ray_cluster(ray_connection):
    """The module's local Ray (tests/conftest.py `ray_connection`, 4 CPUs: one each for the trainer and
    two engines)."""
    yield


@pytest.fixture(params=[*NAMES, *[pytest.param(("ray", n), marks=pytest.mark.slow, id=f"ray-{n.value}")
                                  for n in NAMES]],
                ids=lambda p: p.value if isinstance(p, TransportName) else None)
def contract(request, ckpt):
    if isinstance(request.param, TransportName):
        yield local_contract(request.param, ckpt)
        return
    if not _ray_runs(request.node):
        pytest.skip("through Ray: the checked sync of a fleet and the restart (the rest in-process)")
    import ray

    from miles.orchestrate.handles import spawn

    request.getfixturevalue("ray_cluster")
    spawned = []

    def spawn_actor(cls, *args, **kwargs):
        handle = spawn(cls, True, *args, **kwargs)
        spawned.append(handle)
        return handle

    yield Contract(request.param[1], ckpt, spawn=spawn_actor, restart=lambda handle: handle.restart(), ray=True)
    for handle in spawned:
        ray.kill(handle.actor)
