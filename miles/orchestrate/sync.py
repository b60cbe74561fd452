"""Weight sync trainer -> rollout engine as the loops do it, through the components' handles.

`sync_weights` is one step's sync; `fetch_weights` / `load_weights` are its two halves, apart for
the asynchronous rollout (miles/orchestrate/rollout_ahead.py), which takes a snapshot after a train
step and loads it into the engine later, between two collections.
"""

from __future__ import annotations

import time


def fetch_weights(ctx) -> tuple:
    """(weights, digest) of the trainer's current weights, as futures of its handle. Both components
    in this process: the trainer's flat sync buffer on its device (miles/transport/flat.py), refilled
    by the next fetch; else host tensors through the handles (Ray's object store)."""
    in_process = ctx.engine.in_process and ctx.trainer.in_process
    return tuple(ctx.trainer.submit("get_weights", num_returns=2, **({"in_process": True} if in_process else {})))


def load_weights(ctx, weights, digest, check: bool) -> None:
    """Load a fetched snapshot into the engine; with `check`, the engine verifies the checksum."""
    ctx.engine.get(ctx.engine.submit("update_weights", weights, digest if check else None))
    ctx.after_sync(ctx)


def sync_weights(ctx, check: bool) -> float:
    """Push the trainer's weights to the engine (a collective transport when the run has one, see
    `LoopContext.weight_sync`); returns the seconds it took."""
    if ctx.engine is None or ctx.trainer is None:  # debug.rollout_only / debug.train_only
        return 0.0
    if ctx.weight_sync is not None:  # rollout.weight_sync=broadcast: a collective, not the object store
        elapsed = ctx.weight_sync.sync(check)
        ctx.after_sync(ctx)
        return elapsed
    start = time.perf_counter()
    load_weights(ctx, *fetch_weights(ctx), check)
    if ctx.draft_sync:  # the separate draft model the trainer trained online
        weights, digest = ctx.trainer.call("get_draft_weights")
        ctx.engine.call("update_draft_weights", weights, digest if check else None)
    return time.perf_counter() - start
