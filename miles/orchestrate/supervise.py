"""The training loop under supervision: resume, periodic checkpoints, signals and failed components.

`supervise(cfg, store, build, loop, ...)` builds the components (`build() -> LoopContext`), restores
the newest checkpoint of `store` if there is one, pushes the trainer's weights to the engine and
runs `loop(ctx)`; then:

- every `checkpoint.interval` steps, and after the last one, it saves a checkpoint (resume.py);
- on SIGINT / SIGTERM it lets the current step finish, saves a checkpoint and raises `Stopped`
  (a second signal interrupts at once);
- a rollout engine actor that dies is replaced by a fresh one, given the trainer's weights, and the
  call that failed is sent again: the step goes on with the same prompts;
- any other failure (a trainer that dies or raises, ...) tears the components down, builds them
  again and resumes from the newest checkpoint (or from the start without one).

Engine restarts and resumes together are bounded by `fault.max_retries`.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from miles.config.schema import RunCfg
from miles.orchestrate.checkpoints import copy_tokenizer
from miles.orchestrate.handles import RayHandle
from miles.orchestrate.loop import LoopContext, sync_weights
from miles.orchestrate.resume import (CheckpointStore, flat_config, load_component_state, load_driver_rng,
                                      read_meta, save_component_state)


class Stopped(Exception):
    """A signal stopped the run after `step`; `checkpoint` holds its state (None: nothing saved)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class SignalFlag:
    """SIGINT / SIGTERM set `signum` instead of interrupting; a second signal interrupts at once.
    Handlers only exist in the main thread (a test calling `run` from another thread gets none)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        # Called again after each build: ray.init replaces the driver's SIGTERM handler.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second one: stop waiting for the step to end
            self.restore()
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step "
              "(send it again to stop at once)", flush=True)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


class FaultBudget:
    def __init__(self, max_retries: int, log: Callable[[str], None]):
        self.left, self.max, self.log = max_retries, max_retries, log

    def spend(self, what: str, error: BaseException, action: str) -> None:
        """Use one retry to `action` after `what`, or re-raise `error` when none is left."""
        if self.left <= 0:
            self.log(f"{what}: no retries left (fault.max_retries={self.max})")
            raise error
        self.left -= 1
        self.log(f"{what} ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                 f"{action}, retry {self.max - self.left}/{self.max}")


@dataclass
class _Pending:
    method: str
    args: tuple
    kwargs: dict
    ref: object


class RestartingEngine:
    """A RayHandle whose actor is replaced when it dies: `on_restart()` then brings the new actor up
    to date (weights) and the failed call is sent again with the same arguments."""

    def __init__(self, handle: RayHandle, budget: FaultBudget, on_restart: Callable[[], None]):
        self.handle, self.budget, self.on_restart = handle, budget, on_restart

    @property
    def in_process(self) -> bool:
        return self.handle.in_process

    def _died(self, error: BaseException) -> bool:
        from ray.exceptions import RayActorError

        # A dead producer of an argument (the trainer, during a sync) is not this actor's death.
        return isinstance(error, RayActorError) and error.actor_id in (None, self.handle.actor._actor_id.hex())

    def _restart(self, error: BaseException) -> None:
        self.budget.spend("the rollout engine actor died", error, "restarting it")
        self.handle.restart()
        self.on_restart()

    def submit(self, method: str, *args, **kwargs) -> _Pending:
        return _Pending(method, args, kwargs, self.handle.submit(method, *args, **kwargs))

    def get(self, pending: _Pending):
        while True:
            try:
                return self.handle.get(pending.ref)
            except Exception as error:
                if not self._died(error):
                    raise
                self._restart(error)
                pending.ref = self.handle.submit(pending.method, *pending.args, **pending.kwargs)

    def call(self, method: str, *args, **kwargs):
        return self.get(self.submit(method, *args, **kwargs))

    def apply(self, fn, *args):
        while True:
            try:
                return self.handle.apply(fn, *args)
            except Exception as error:
                if not self._died(error):
                    raise
                self._restart(error)

    @property
    def actor(self):
        return self.handle.actor


class Checkpointer:
    """Saves checkpoints from the loop's `after_step` hook and turns a pending signal into `Stopped`."""

    def __init__(self, cfg: RunCfg, store: CheckpointStore, ctx: LoopContext, flag: SignalFlag,
                 tokenizer_dir: Path, run_info: dict, log: Callable[[str], None]):
        self.cfg, self.store, self.ctx, self.flag = cfg, store, ctx, flag
        self.tokenizer_dir, self.run_info, self.log = tokenizer_dir, run_info, log
        self.saved_step = -1
        self.objective = 0.0  # the last eval accuracy seen by ctx.log, kept in the checkpoint

    def save(self, step: int) -> Path | None:
        if not self.store.enabled or step == self.saved_step:
            return self.store.latest() if self.store.enabled else None
        ctx = self.ctx

        def write(tmp: Path) -> None:
            for name, handle in components(ctx):
                handle.apply(save_component_state, str(tmp), name)
            copy_tokenizer(self.tokenizer_dir, tmp / "model")

        meta = {"objective": self.objective, "source": ctx.source.state(), "config": flat_config(self.cfg),
                **self.run_info}
        path = self.store.save(step, write, meta)
        self.saved_step = step
        self.log(f"checkpoint: {path}")
        return path

    def after_step(self, step: int) -> None:
        if self.flag.signum is not None:
            raise Stopped(self.flag.signum, step, self.save(step))
        interval = self.cfg.checkpoint.interval
        if interval and step % interval == 0:
            self.save(step)

    def observe(self, log: Callable[[dict, int], None]) -> Callable[[dict, int], None]:
        """Wrap the loop's log callback to remember the last eval accuracy (the run's objective)."""

        def logged(metrics: dict, step: int) -> None:
            for key, value in metrics.items():
                if key.startswith("eval/"):
                    self.objective = float(value)
            log(metrics, step)

        return logged


def components(ctx: LoopContext) -> list[tuple[str, object]]:
    """(name, handle) of the components a run has (debug modes leave one out; only PPO has a critic)."""
    return [(n, h) for n, h in (("trainer", ctx.trainer), ("engine", ctx.engine), ("critic", ctx.critic))
            if h is not None]


def restore(ctx: LoopContext, path: Path) -> tuple[int, float]:
    """Load a checkpoint into freshly built components; returns (step, objective)."""
    meta = read_meta(path)
    for name, handle in components(ctx):
        handle.apply(load_component_state, str(path), name)
    ctx.source.load_state(meta["source"])
    load_driver_rng(path / "driver.pt")
    return meta["step"], meta["objective"]


def _teardown(ctx: LoopContext) -> None:
    import ray

    for _, handle in components(ctx):
        if hasattr(handle, "actor"):
            try:
                ray.kill(handle.actor, no_restart=True)
            except Exception:  # already gone: nothing to free
                pass


def supervise(cfg: RunCfg, store: CheckpointStore, build: Callable[[], LoopContext],
              loop: Callable[[LoopContext], float], tokenizer_dir: Path, run_info: dict,
              log: Callable[[str], None] = print) -> tuple[float, LoopContext]:
    """Run `loop` to the end; returns (objective, the context of the components that finished)."""
    budget = FaultBudget(cfg.fault.max_retries, log)
    flag = SignalFlag()
    initial_source = None
    try:
        while True:
            ctx = build()
            flag.install()
            if initial_source is None:
                initial_source = ctx.source.state()
            if isinstance(ctx.engine, RayHandle):
                ctx.engine = RestartingEngine(ctx.engine, budget,
                                              on_restart=lambda c=ctx: sync_weights(c, cfg.rollout.check_weight_sync))
            keeper = Checkpointer(cfg, store, ctx, flag, tokenizer_dir, run_info, log)
            ctx.log, ctx.after_step = keeper.observe(ctx.log), keeper.after_step
            try:
                latest = store.latest()
                if latest is not None:
                    ctx.start_step, keeper.objective = restore(ctx, latest)
                    keeper.saved_step = ctx.start_step
                    log(f"resuming from {latest} (step {ctx.start_step} of {cfg.steps})")
                else:
                    ctx.source.load_state(initial_source)
                # The engine starts from the trainer's weights; one checked sync proves the path works.
                sync_weights(ctx, check=cfg.rollout.check_weight_sync)
                objective = loop(ctx) if ctx.start_step < cfg.steps else keeper.objective
                keeper.save(cfg.steps)
                return objective, ctx
            except Stopped:
                raise
            except Exception as error:
                budget.spend("the run failed", error, "resuming from the last checkpoint" if store.latest()
                             else "starting over (no checkpoint yet)")
                if cfg.ray.enabled:
                    _teardown(ctx)
    finally:
        flag.restore()
