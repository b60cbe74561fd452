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

Engine restarts and resumes together are bounded by `fault.max_retries`. A fault a retry can cure
(`transient`: a dead actor, a lost node or object, a timeout, a broken connection) may use them all;
any other failure is retried once, and if the retry fails with the same error at the same step
(`Fault.signature`: root-cause type, message less pids / ids / addresses / memory sizes, where it was raised,
step) the run stops at once with `RepeatedFault`, naming the cause and where it was raised,
instead of repeating an identical restart until the budget is spent.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch

from miles.config.schema import RunCfg
from miles.orchestrate.checkpoints import copy_tokenizer
from miles.orchestrate.handles import RayHandle
from miles.orchestrate.loop import LoopContext
from miles.orchestrate.sync import sync_weights
from miles.transport.device import free_device_memory
from miles.orchestrate.resume import (CheckpointStore, flat_config, load_component_state, load_driver_rng,
                                      read_meta, save_component_state)

T = TypeVar("T")


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


def _transient_types() -> tuple[type, ...]:
    """Faults a retry can cure: the process, node, object or connection is gone, not the code wrong."""
    try:
        import ray.exceptions as rx
    except ImportError:  # an in-process run on a machine without Ray: no Ray faults to cure
        return (ConnectionError, TimeoutError)
    names = ("RayActorError", "NodeDiedError", "LocalRayletDiedError", "WorkerCrashedError", "ObjectLostError",
             "GetTimeoutError", "RayChannelTimeoutError", "RpcError")
    return (ConnectionError, TimeoutError, *(getattr(rx, n) for n in names if hasattr(rx, n)))


def _is_ray_task_error(error: BaseException) -> bool:
    try:
        from ray.exceptions import RayTaskError
    except ImportError:  # without Ray nothing ran remotely
        return False
    return isinstance(error, RayTaskError)


def _constructor_failed(error: BaseException) -> bool:
    """An actor that died because its constructor raised (Ray's ActorDiedError with
    actor_init_failed; its message holds the creation task's traceback): the code is wrong, not the
    process gone, so a fresh actor fails the same way."""
    return bool(getattr(error, "actor_init_failed", False))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_EXCEPTION_LINE = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Fault)): ?(.*)$")
_VOLATILE = [(re.compile(r"0x[0-9a-fA-F]+"), "0x?"), (re.compile(r"\b[0-9a-f]{16,}\b"), "<id>"),
             (re.compile(r"\bpid=\d+"), "pid=?"), (re.compile(r"\bip=[\w.:]+"), "ip=?"),
             # amounts of memory: a CUDA out-of-memory error names the free bytes, which vary by a few MiB
             (re.compile(r"\b\d+(?:\.\d+)? ?(?:[KMGT]i?B|bytes)\b"), "<size>")]


def _short_path(path: str) -> str:
    """A source path as people read it: below site-packages, or relative to the checkout."""
    if "site-packages" + os.sep in path:
        return path.rsplit("site-packages" + os.sep, 1)[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else path


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


@dataclass(frozen=True)
class Fault:
    """What failed, told from the root cause: inside a Ray task error, the exception the remote
    code raised (not Ray's wrapper) and the frame that raised it."""

    type: str  # the root cause's exception type
    message: str  # its first line
    where: str  # "path:line in function", and the Ray task it ran in
    transient: bool  # a retry can cure it (see _transient_types)
    at: str = ""  # the run's position: "in step N", "before step N (restore, first weight sync)"

    @classmethod
    def of(cls, error: BaseException, at: str = "") -> "Fault":
        transient = isinstance(error, _transient_types()) and not _constructor_failed(error)
        if _is_ray_task_error(error) or _constructor_failed(error):
            cause = getattr(error, "cause", None) or error
            transient = transient or isinstance(cause, _transient_types()) and not _constructor_failed(cause)
            text = _ANSI.sub("", str(error))  # the remote traceback, down to the innermost error
            task = re.search(r"ray::[\w.]+\(\)", text)
            lines = [line for line in text.splitlines() if line.strip()]
            root = next((m for line in reversed(lines) if (m := _EXCEPTION_LINE.match(line))), None)
            kind, message = (root.group(1).rsplit(".", 1)[-1], root.group(2)) if root else \
                (type(cause).__name__, _first_line(str(cause)))
            frames = _FRAME.findall(text)
            where = f"{_short_path(frames[-1][0])}:{frames[-1][1]} in {frames[-1][2]}" if frames else ""
            if task:
                where = f"{where}, in {task.group(0)}" if where else f"in {task.group(0)}"
            return cls(kind, message, where, transient, at)
        frames = traceback.extract_tb(error.__traceback__)
        where = f"{_short_path(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
        return cls(type(error).__name__, _first_line(str(error)), where, transient, at)

    @property
    def signature(self) -> tuple[str, str, str, str]:
        """Equal for two failures of one deterministic fault (pids, actor ids, addresses removed)."""
        message = self.message
        for pattern, replacement in _VOLATILE:
            message = pattern.sub(replacement, message)
        return self.type, message, self.where, self.at

    def describe(self) -> str:
        return f"{self.type}: {self.message}" + (f" ({self.where})" if self.where else "")

    @property
    def hint(self) -> str:
        """What to change for a failure of this kind (empty where there is no general advice)."""
        return _HINTS.get(self.type, "")


# Failures whose repeat says the config asks too much: the keys that lower it.
_HINTS = {"OutOfMemoryError": "the GPU ran out of memory; `dry_run=true` with the same overrides prints the memory "
                              "plan, and what lowers the peak is trainer.recompute=true, a smaller "
                              "trainer.max_tokens_per_micro_batch (packed) or trainer.micro_batch_size (padded), a "
                              "smaller rollout.max_running, or, on a colocated GPU, rollout.offload=true, "
                              "trainer.offload=true, trainer.offload_optimizer=true"}


class RepeatedFault(RuntimeError):
    """A failure that came back identical after a retry: deterministic, so no more retries."""

    def __init__(self, fault: Fault):
        super().__init__(f"the run failed again {fault.at} with the same error, so it was not retried: "
                         f"{fault.describe()}" + (f"; {fault.hint}" if fault.hint else ""))
        self.fault = fault


class FaultBudget:
    def __init__(self, max_retries: int, log: Callable[[str], None]):
        self.left, self.max, self.log = max_retries, max_retries, log
        self.last: Fault | None = None  # the previous failure

    def spend(self, what: str, error: BaseException, action: str, at: str = "") -> None:
        """Use one retry to `action` after `what`, or re-raise `error` when none is left. A failure
        that a retry does not cure (not transient, the same signature as the previous failure)
        raises RepeatedFault from `error` without spending one."""
        fault = Fault.of(error, at)
        previous, self.last = self.last, fault
        if not fault.transient and previous is not None and previous.signature == fault.signature:
            self.log(f"{what} again {fault.at} with the same error: a fault a retry does not cure, so no more "
                     f"retries ({self.max - self.left} of fault.max_retries={self.max} used)\n"
                     f"  error: {fault.type}: {fault.message}\n  where: {fault.where or 'unknown'}"
                     + (f"\n  what to change: {fault.hint}" if fault.hint else ""))
            raise RepeatedFault(fault) from error
        if self.left <= 0:
            self.log(f"{what}: no retries left (fault.max_retries={self.max})")
            raise error
        self.left -= 1
        self.log(f"{what} ({fault.type}: {fault.message}); {action}, retry {self.max - self.left}/{self.max}")


@dataclass
class _Pending:
    method: str
    args: tuple
    kwargs: dict
    ref: object


class RestartingEngine:
    """A RayHandle whose actor is replaced when it dies: `on_restart()` then brings the new actor up
    to date (weights) and the failed call is sent again with the same arguments. A weight sync is
    retried whole instead (`around_sync`)."""

    def __init__(self, handle: RayHandle, budget: FaultBudget, on_restart: Callable[[], None]):
        self.handle, self.budget, self.on_restart = handle, budget, on_restart
        self._syncing = False  # inside around_sync: a death propagates to it, no call is retried alone

    @property
    def in_process(self) -> bool:
        return self.handle.in_process

    @property
    def members(self) -> list["RestartingEngine"]:
        return [self]

    def _died(self, error: BaseException) -> bool:
        from ray.exceptions import RayActorError

        # A dead producer of an argument (the trainer, during a sync) is not this actor's death.
        return isinstance(error, RayActorError) and error.actor_id in (None, self.handle.actor._actor_id.hex())

    def around_sync(self, sync: Callable[[], T]) -> T:
        """Run a whole weight sync; when this engine dies during it, restart the engine and run the
        sync again from its start. Why not retry the failed call alone: a transport's calls (a
        segment's load, a broadcast) refer to what it set up with the dead actor; the new actor has
        none of it, and the transport sets it up again when it sees the actor replaced."""
        self._syncing = True
        try:
            while True:
                try:
                    return sync()
                except Exception as error:
                    if not self._died(error):
                        raise
                    self.budget.spend("the rollout engine actor died", error, "restarting it")
                    self.handle.restart()  # no on_restart: the sync run again is what it would do
        finally:
            self._syncing = False

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
                if self._syncing or not self._died(error):
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
                if self._syncing or not self._died(error):
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
        self.done_step = ctx.start_step  # the last step the loop finished (where a failure happened)
        self.objective = 0.0  # the last eval accuracy seen by ctx.log, kept in the checkpoint

    def save(self, step: int) -> Path | None:
        if not self.store.enabled or step == self.saved_step:
            return self.store.latest() if self.store.enabled else None
        ctx = self.ctx

        def write(tmp: Path) -> None:
            for name, handle in components(ctx):
                handle.apply(save_component_state, str(tmp), name)
            copy_tokenizer(self.tokenizer_dir, tmp / "model")

        meta = {"objective": self.objective, "source": (ctx.source_state or ctx.source.state)(),
                "config": flat_config(self.cfg), **self.run_info}
        path = self.store.save(step, write, meta)
        self.saved_step = step
        self.log(f"checkpoint: {path}")
        return path

    def after_step(self, step: int) -> None:
        self.done_step = step
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
    for _, component in components(ctx):
        if hasattr(component, "shutdown"):  # an FSDP group: its rank actors and placement group
            component.shutdown()
            continue
        for handle in getattr(component, "engines", [component]):  # an EngineFleet: each engine
            if hasattr(handle, "actor"):  # a Ray actor (so Ray is there)
                import ray

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
            looping = False
            try:
                latest = store.latest()
                if latest is not None:
                    ctx.start_step, keeper.objective = restore(ctx, latest)
                    keeper.saved_step = keeper.done_step = ctx.start_step
                    log(f"resuming from {latest} (step {ctx.start_step} of {cfg.steps})")
                else:
                    ctx.source.load_state(initial_source)
                # The engine starts from the trainer's weights; one checked sync proves the path works.
                sync_weights(ctx, check=cfg.rollout.check_weight_sync)
                looping = True
                objective = loop(ctx) if ctx.start_step < cfg.steps else keeper.objective
                keeper.save(cfg.steps)
                return objective, ctx
            except Stopped:
                raise
            except Exception as error:
                step = keeper.done_step + 1
                at = (f"in step {step}" if step <= cfg.steps else "after the last step") if looping else \
                    f"before step {step} (restore, first weight sync)"
                budget.spend("the run failed", error, "resuming from the last checkpoint" if store.latest()
                             else "starting over (no checkpoint yet)", at)
                if cfg.ray.enabled:
                    _teardown(ctx)
            # In one process the failed components still hold their device memory (an OOM retried
            # beside them ran out again at once): drop them before the retry builds new ones.
            ctx = keeper = None
            if not cfg.ray.enabled and torch.cuda.is_initialized():
                gc.collect()
                free_device_memory(torch.device("cuda"))
    finally:
        flag.restore()
