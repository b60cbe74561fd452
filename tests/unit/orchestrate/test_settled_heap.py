"""The driver's loop runs with its start-up heap frozen out of full collections (handles.settled_heap):
a full collection of a run's heap took 280-360 ms on a 2-core CPU and landed inside a timed step."""

import gc

from miles.orchestrate.handles import settled_heap


def test_the_loop_runs_frozen_and_leaves_nothing_frozen():
    gc.unfreeze()  # a normal heap to start from
    kept = [object() for _ in range(1000)]
    with settled_heap():
        frozen = gc.get_freeze_count()
        assert frozen >= len(kept)  # alive at the start: in the permanent generation
        gc.collect()
        assert gc.get_freeze_count() == frozen  # a full collection leaves them there
    assert gc.get_freeze_count() == 0  # another run in this process starts from a normal heap


def test_an_error_in_the_loop_still_unfreezes():
    try:
        with settled_heap():
            raise RuntimeError("the loop failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
