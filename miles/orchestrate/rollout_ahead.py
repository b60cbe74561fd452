"""Asynchronous rollout (`rollout.asynchronous=true`): the next steps' rollouts are generated while
the trainer trains, by a policy at most `rollout.max_staleness` steps behind the trainer's.

    ahead = RolloutAhead(ctx, cfg, collect)   # a rollout thread starts generating step 1
    samples, metrics = ahead.next(step)       # the scored batch of `step` (waits if not ready)
    ahead.publish(step, updated=True)         # after training `step`: its weights are the newest
    with ahead.engine_idle():                 # the engine to oneself, newest weights loaded
        evaluate(ctx, step)
    ahead.close()

How it runs:
- One rollout thread calls `collect(ctx, cfg, step)` for the steps in order (the whole collection:
  several generate calls under dynamic sampling, multi-turn trajectories, reward scoring), so the
  engine is only ever used by one caller at a time. The trainer, in the loop's thread, never waits
  for the engine except for a batch that is not ready yet.
- Staleness: step j's batch starts generating only once the trainer has finished step
  j - 1 - max_staleness, and with the newest weights published so far; `rollout/staleness` is
  (j - 1) minus the step of those weights: 0 for a synchronous rollout, at most max_staleness.
  With max_staleness=1, batch j+1 is generated while the trainer trains on batch j (the one-step
  off-policy schedule of slime's train_async / AReaL).
- The samples keep the behaviour policy's log-probs (`rollout_logprobs`). By default
  (`algo.use_rollout_logprobs: null`) they are PPO's old policy when the rollout lags, so the ratio
  and its clip are against the policy that sampled (miles.orchestrate.run.trainer_algo); `algo.tis`
  / `algo.mis` apply on top, as for the kernel mismatch.
- Weights: `publish` takes a snapshot in the loop's thread (the trainer's `get_weights`: a Ray
  object reference, or in-process the trainer's sync buffer, refilled under a lock); the rollout
  thread loads the newest snapshot into the engine before each collection. A collective transport
  (`rollout.weight_sync=broadcast`, `shared_memory`) needs the engine idle instead: `publish` then
  waits for the collection in flight and syncs at once.
- Resume: a checkpoint after step k records the data position before batch k+1 was drawn, so a
  resumed run generates the batches that were in flight again (with its restored weights): no
  prompt is skipped or trained twice. The staleness of the first resumed steps is then 0.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Callable

from miles.orchestrate.sync import load_weights, whole_sync


class RolloutAhead:
    def __init__(self, ctx, cfg, collect: Callable):
        self.ctx, self.cfg, self.collect, self.check = ctx, cfg, collect, cfg.rollout.check_weight_sync
        self.max_staleness, self.last_step = cfg.rollout.max_staleness, cfg.steps
        self.collective = not ctx.transport.snapshots  # broadcast / shared memory: the engine must be idle
        self._cond = threading.Condition()  # guards the fields below and wakes the rollout thread
        self.trained_step = ctx.start_step  # the newest step the trainer finished (its weights published)
        self._snapshot: tuple | None = None  # (weights, digest) of trained_step; None: the engine has them
        self.engine_step = ctx.start_step  # the step of the weights the engine holds (synced at start)
        self._stop = False
        self._weights_lock = threading.Lock()  # an in-process snapshot is the trainer's one sync buffer
        self._engine_lock = threading.Lock()  # held while the engine generates, loads or evaluates
        self._states: dict[int, dict] = {}  # step -> data position before its batch was drawn
        self._batches: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rollout-ahead", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop's side
    def next(self, step: int) -> tuple[list, dict[str, float]]:
        """The scored batch of `step` and its rollout metrics (+ `rollout/staleness`,
        `perf/rollout_wait_s`: how long the trainer waited for it)."""
        start = time.perf_counter()
        item = self._batches.get()
        if isinstance(item, BaseException):
            raise item
        got, samples, metrics = item
        assert got == step, f"rollout thread delivered step {got}, the loop is at {step}"
        return samples, {**metrics, "perf/rollout_wait_s": time.perf_counter() - start}

    def publish(self, step: int, updated: bool) -> float:
        """The trainer finished `step` (`updated`: its weights changed); returns the seconds the loop
        spent handing the weights over."""
        start = time.perf_counter()
        if updated and self.collective:
            with self._engine_lock:
                whole_sync(self.ctx, self.check)
                self.ctx.after_sync(self.ctx)
                with self._cond:
                    self._snapshot, self.engine_step = None, step
        elif updated:
            with self._weights_lock:
                snapshot = self.ctx.transport.fetch()
                with self._cond:
                    self._snapshot = snapshot
        with self._cond:
            if self._snapshot is None and self.engine_step == self.trained_step:
                self.engine_step = step  # unchanged weights: the engine's are still the newest
            self.trained_step = step
            self._cond.notify_all()
        return time.perf_counter() - start

    @contextlib.contextmanager
    def engine_idle(self):
        """The engine to the caller (evaluation), with the newest published weights."""
        with self._engine_lock:
            self._load_newest()
            yield

    def source_state(self) -> dict:
        """The data position a checkpoint after the last trained step records: before the first
        batch not trained yet was drawn (its prompts are drawn again on resume)."""
        with self._cond:
            state = self._states.get(self.trained_step + 1)
            return state if state is not None else self.ctx.source.state()

    def close(self) -> None:
        """Stop after the collection in flight (if any) and wait for the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    # ------------------------------------------------------------------ the rollout thread
    def _run(self) -> None:
        try:
            for step in range(self.ctx.start_step + 1, self.last_step + 1):
                with self._cond:
                    while not self._stop and self.trained_step < step - 1 - self.max_staleness:
                        self._cond.wait()
                    if self._stop:
                        return
                    self._states = {j: v for j, v in self._states.items() if j > self.trained_step}
                    self._states[step] = self.ctx.source.state()
                with self._engine_lock:
                    load_s = self._load_newest()
                    staleness = step - 1 - self.engine_step
                    start = time.perf_counter()
                    samples, metrics = self.collect(self.ctx, self.cfg, step)
                    generated = time.perf_counter() - start
                tokens = sum(len(s.response_ids) for s in samples)
                self._batches.put((step, samples, {
                    **metrics, "rollout/staleness": float(staleness), "perf/rollout_time_s": generated,
                    "rollout/tokens_per_s": tokens / max(generated, 1e-9), "perf/weight_load_s": load_s}))
        except BaseException as error:  # the loop raises it at its next batch
            self._batches.put(error)

    def _load_newest(self) -> float:
        """Load the newest published snapshot into the engine (engine lock held); its seconds. The
        weights lock keeps an in-process snapshot (the trainer's one buffer) from being refilled
        between taking it and loading it."""
        start = time.perf_counter()
        with self._weights_lock:
            with self._cond:
                snapshot, step = self._snapshot, self.trained_step
                self._snapshot = None
            if snapshot is None:
                return 0.0
            load_weights(self.ctx, snapshot, self.check)
        with self._cond:
            self.engine_step = step
        return time.perf_counter() - start
