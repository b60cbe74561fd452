"""The supervisor's retry decisions (miles.orchestrate.supervise): a fault a retry can cure keeps the
retry budget; a failure that comes back identical (root cause, place, step) after one retry stops
the run with one report of its cause instead of identical restarts."""

import pytest
import torch
import ray.exceptions as rx

from miles.orchestrate.supervise import Fault, FaultBudget, RepeatedFault

TORCH_TB = """Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/ray/_private/serialization.py", line 366, in _deserialize_pickle5_data
    obj = pickle.loads(in_band)
  File "/venv/lib/python3.11/site-packages/torch/serialization.py", line 1818, in persistent_load
    dtype = storage_type.dtype
            ^^^^^^^^^^^^^^^^^^
AttributeError: type object 'torch.storage.UntypedStorage' has no attribute 'dtype'"""


def ray_task_error(pid: int, actor_id: str) -> BaseException:
    """What ray.get raises when an actor task cannot load its argument (the FP8 sync before the fix)."""
    cause = rx.RaySystemError("type object 'torch.storage.UntypedStorage' has no attribute 'dtype'", TORCH_TB)
    error = rx.RayTaskError("update_weights", TORCH_TB, cause, proctitle="ray::NativeEngine.update_weights",
                            pid=pid, ip="10.0.0.1", actor_repr=f"<NativeEngine object at 0x7f{pid:x}>",
                            actor_id=actor_id)
    return error.as_instanceof_cause()


def raised(make) -> BaseException:
    """An exception as the supervisor gets it: raised, with a traceback (always from this line)."""
    try:
        raise make()
    except BaseException as error:  # noqa: BLE001 - returned, not swallowed
        return error


def budget(max_retries=3):
    lines: list[str] = []
    return FaultBudget(max_retries, lines.append), lines


def test_a_ray_task_error_is_told_from_its_root_cause():
    fault = Fault.of(ray_task_error(4217, "3409c29e43633ea2eacac6c601000000"), "before step 1")
    assert fault.type == "AttributeError"
    assert fault.message == "type object 'torch.storage.UntypedStorage' has no attribute 'dtype'"
    assert fault.where == "torch/serialization.py:1818 in persistent_load, in ray::NativeEngine.update_weights()"
    assert not fault.transient


def test_a_local_error_names_the_frame_that_raised_it():
    fault = Fault.of(raised(lambda: RuntimeError("broken trainer\nmore detail")), "in step 3")
    assert (fault.type, fault.message, fault.at) == ("RuntimeError", "broken trainer", "in step 3")
    assert fault.where.startswith("tests/unit/orchestrate/test_fault_classify.py:")
    assert fault.where.endswith(" in raised")


def test_an_identical_failure_stops_after_the_first_retry_with_its_cause():
    faults, log = budget()
    faults.spend("the run failed", ray_task_error(4217, "aa" * 16), "starting over", "before step 1")
    assert log == ["the run failed (AttributeError: type object 'torch.storage.UntypedStorage' has no attribute "
                   "'dtype'); starting over, retry 1/3"]
    again = ray_task_error(4390, "bb" * 16)  # a new actor: another pid, actor id and address
    with pytest.raises(RepeatedFault) as stop:
        faults.spend("the run failed", again, "starting over", "before step 1")
    assert stop.value.__cause__ is again and faults.left == 2
    assert str(stop.value) == (
        "the run failed again before step 1 with the same error, so it was not retried: AttributeError: type "
        "object 'torch.storage.UntypedStorage' has no attribute 'dtype' (torch/serialization.py:1818 in "
        "persistent_load, in ray::NativeEngine.update_weights())")
    report = log[-1].splitlines()
    assert report[0] == ("the run failed again before step 1 with the same error: a fault a retry does not cure, "
                         "so no more retries (1 of fault.max_retries=3 used)")
    assert report[1:] == [
        "  error: AttributeError: type object 'torch.storage.UntypedStorage' has no attribute 'dtype'",
        "  where: torch/serialization.py:1818 in persistent_load, in ray::NativeEngine.update_weights()"]


def test_pids_ids_and_addresses_do_not_make_a_failure_new():
    a = Fault.of(raised(lambda: ValueError("worker pid=101 at 0x7f00aa: bad shape")), "in step 2")
    b = Fault.of(raised(lambda: ValueError("worker pid=202 at 0x7f00bb: bad shape")), "in step 2")
    assert a.signature == b.signature


@pytest.mark.parametrize("second", [
    lambda: (RuntimeError("loss is nan"), "in step 3"),  # another message
    lambda: (RuntimeError("loss is inf"), "in step 4"),  # another step
], ids=["message", "step"])
def test_a_different_failure_is_retried(second):
    faults, log = budget()
    faults.spend("the run failed", raised(lambda: RuntimeError("loss is inf")), "resuming", "in step 3")
    error, at = second()
    faults.spend("the run failed", raised(lambda: error), "resuming", at)
    assert faults.left == 1 and log[-1].endswith("resuming, retry 2/3")


def test_different_failures_are_bounded_by_max_retries():
    faults, log = budget(2)
    for n in range(2):
        faults.spend("the run failed", raised(lambda: RuntimeError(f"flaky reward server, attempt {n}")), "resuming",
                     "in step 1")
    last = raised(lambda: RuntimeError("flaky reward server, attempt 2"))
    with pytest.raises(RuntimeError) as out:
        faults.spend("the run failed", last, "resuming", "in step 1")
    assert out.value is last and log[-1] == "the run failed: no retries left (fault.max_retries=2)"


@pytest.mark.parametrize("make", [
    rx.ActorDiedError, lambda: rx.NodeDiedError("node 10.0.0.2 lost"), lambda: rx.GetTimeoutError("get timed out"),
    lambda: ConnectionResetError("connection reset by peer"), lambda: rx.ObjectLostError("ab" * 14, "owner", ""),
], ids=["actor-died", "node-lost", "get-timeout", "connection", "object-lost"])
def test_a_fault_a_retry_can_cure_keeps_the_whole_budget_even_when_it_repeats(make):
    faults, log = budget()
    for _ in range(3):
        faults.spend("the trainer died", raised(make), "resuming", "in step 2")
    assert Fault.of(raised(make)).transient and faults.left == 0 and log[-1].endswith("retry 3/3")
    with pytest.raises(type(make())):
        faults.spend("the trainer died", raised(make), "resuming", "in step 2")


def test_a_ray_task_error_caused_by_a_dead_actor_is_transient():
    cause = rx.ActorDiedError()
    error = rx.RayTaskError("generate", "Traceback (most recent call last):\nActorDiedError: died", cause,
                            proctitle="ray::NativeEngine.generate", pid=1, ip="10.0.0.1")
    assert Fault.of(error.as_instanceof_cause()).transient


def test_an_out_of_memory_error_is_the_same_failure_whatever_memory_was_free():
    """Two CUDA OOMs of one run on an H100 (2026-12-06): the free memory differed by 2 MiB, so the
    run restarted twice before the signatures matched."""
    oom = ("CUDA out of memory. Tried to allocate 152.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which "
           "{} MiB is free. Including non-PyTorch memory, this process has 79.12 GiB memory in use.")
    faults, log = budget()
    faults.spend("the run failed", raised(lambda: torch.OutOfMemoryError(oom.format("52.19"))), "starting over",
                 "in step 1")
    with pytest.raises(RepeatedFault) as stop:
        faults.spend("the run failed", raised(lambda: torch.OutOfMemoryError(oom.format("50.19"))), "starting over",
                     "in step 1")
    assert faults.left == 2
    # the report and the error name what lowers the peak
    assert log[-1].splitlines()[-1].startswith("  what to change: the GPU ran out of memory; `dry_run=true`")
    assert "trainer.recompute=true" in str(stop.value) and "trainer.offload_optimizer=true" in str(stop.value)
    bigger = Fault.of(raised(lambda: torch.OutOfMemoryError("Tried to allocate 3.00 GiB")), "in step 1")
    assert bigger.signature[1] == "Tried to allocate <size>"
