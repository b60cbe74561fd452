"""Weight sync trainer -> rollout engine as the loops do it: the run's transport (miles/transport/:
object store, broadcast, shared memory; `LoopContext.transport`), then what orchestration adds on
top of any of them: the online-trained speculative draft, and the `after_sync` hook (debug checks).

`sync_weights` is one step's sync; the asynchronous rollout (miles/orchestrate/rollout_ahead.py)
uses a snapshot transport's two halves apart (`transport.fetch()` after a train step,
`load_weights` later, between two collections).
"""

from __future__ import annotations

import time


def load_weights(ctx, snapshot: tuple, check: bool) -> None:
    """Load a fetched snapshot into the engine; with `check`, the engine verifies the checksum."""
    ctx.transport.load(snapshot, check)
    ctx.after_sync(ctx)


def whole_sync(ctx, check: bool) -> None:
    """The transport's sync; an engine that restarts on its death (the supervisor's RestartingEngine)
    is restarted and the sync run again from its start when it dies during it."""
    around = getattr(ctx.engine, "around_sync", lambda sync: sync())
    around(lambda: ctx.transport.sync(check))


def sync_weights(ctx, check: bool) -> float:
    """Push the trainer's weights to the engine through the run's transport; returns the seconds it took."""
    if ctx.engine is None or ctx.trainer is None:  # debug.rollout_only / debug.train_only
        return 0.0
    start = time.perf_counter()
    whole_sync(ctx, check)
    ctx.after_sync(ctx)
    if ctx.draft_sync:  # the separate draft model the trainer trained online (validate(): object store only)
        weights, digest = ctx.trainer.call("get_draft_weights")
        ctx.engine.call("update_draft_weights", weights, digest if check else None)
    return time.perf_counter() - start
