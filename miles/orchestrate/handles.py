"""One calling convention for components, in-process or Ray actors (DESIGN rule 4).

`handle.submit(method, *args)` returns a future (a Ray ObjectRef, or the value itself in-process);
futures can be passed as arguments to another handle's submit, so weights move trainer -> engine
through Ray's object store without a copy through the driver; tensors of every dtype (float8
included, which torch's pickle cannot load) cross it as raw bytes (miles/transport/ray_tensors.py).
`handle.call` submits and waits. `handle.apply(fn, *args)` runs `fn(component, *args)` where the
component lives (checkpoint state, debug checks), so such code needs no method on the component
classes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, TypeVar

C = TypeVar("C", covariant=True)  # the component behind the handle: a RolloutEngine, a Trainer


class Handle(Protocol[C]):
    """What the loops call on a component, whatever runs it: `LocalHandle`, `RayHandle`, an
    EngineFleet, the supervisor's restarting wrapper. Methods go by name (`call("generate", ...)`),
    so `C` documents which protocol those names belong to; nothing checks it statically."""
    in_process: bool

    def submit(self, method: str, *args: Any, num_returns: int = 1, **kwargs: Any) -> Any: ...

    def get(self, future: Any) -> Any: ...

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def apply(self, fn: Any, *args: Any) -> Any: ...


class LocalHandle:
    in_process = True  # the component shares this process: tensors pass by reference, on any device

    def __init__(self, obj: Any):
        self.obj = obj

    @property
    def members(self) -> list["LocalHandle"]:
        """The per-engine handles behind this one (an EngineFleet has several): itself."""
        return [self]

    def submit(self, method: str, *args: Any, num_returns: int = 1, **kwargs: Any) -> Any:
        return getattr(self.obj, method)(*args, **kwargs)

    def get(self, future: Any) -> Any:
        return future

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.submit(method, *args, **kwargs)

    def apply(self, fn: Any, *args: Any) -> Any:
        return fn(self.obj, *args)


class RayHandle:
    in_process = False

    def __init__(self, actor: Any, respawn: Any = None):
        self.actor = actor
        self._respawn = respawn  # () -> a new actor built like this one (miles.orchestrate.supervise restarts)

    @property
    def members(self) -> list["RayHandle"]:
        """The per-engine handles behind this one (an EngineFleet has several): itself."""
        return [self]

    def submit(self, method: str, *args: Any, num_returns: int = 1, **kwargs: Any) -> Any:
        remote_method = getattr(self.actor, method)
        if num_returns != 1:
            remote_method = remote_method.options(num_returns=num_returns)
        return remote_method.remote(*args, **kwargs)

    def get(self, future: Any) -> Any:
        import ray

        return ray.get(future)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.get(self.submit(method, *args, **kwargs))

    def apply(self, fn: Any, *args: Any) -> Any:
        return self.get(self.actor.__ray_call__.remote(fn, *args))

    def restart(self) -> None:
        """Replace the actor by a fresh one built from the same constructor arguments."""
        import ray

        ray.kill(self.actor, no_restart=True)
        self.actor = self._respawn()


def start_ray(address: str | None, num_cpus: int | None, runtime_env: dict | None = None,
              num_actors: int = 2, worker_niceness: int | None = 0) -> None:
    """Join `address` ("auto", "ray://...") or start a local Ray; no dashboard, quiet logs.
    `runtime_env` applies to every worker process of this job (e.g. deterministic mode).
    `worker_niceness`: the nice value of a started Ray's workers (None: Ray's default, 15). At 15 the
    actors' OpenMP teams yield to every nice-0 process (Ray's own daemons, the driver), and one
    preempted thread stalls its whole team at the next barrier. A joined cluster keeps its own."""
    import logging
    import os

    import ray

    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    if address:
        kwargs["address"] = address
    else:
        # "local": a new Ray even where one already runs on the machine (a `ray start` there is joined
        # only when asked: ray.address=auto); Ray's own default would join it.
        kwargs["address"] = "local"
        # The one-CPU actors (engine, trainer, PPO's critic) must fit even where Ray counts fewer cores.
        kwargs["num_cpus"] = num_cpus or max(num_actors, os.cpu_count() or 1)
        if worker_niceness is not None:
            kwargs["_system_config"] = {"worker_niceness": worker_niceness}
    ray.init(**kwargs)


def settle_heap() -> None:
    """Collect once, then move every object alive now into the garbage collector's permanent
    generation (`gc.freeze`), so later full collections scan only what the loop allocates.
    A run's driver holds ~1-2M long-lived objects (modules, data, tokenizer): each full collection
    took 280-360 ms on the 2-core CPU VM, about once a run inside the timed steps (issue 28).
    In-process it stalls a step; with Ray it ran on the journal's upload thread and took a core
    from the actor's 2-thread OpenMP team. Objects freed by reference counting are still freed;
    frozen garbage cycles stay until `gc.unfreeze()` (`settled_heap` undoes it when its loop ends)."""
    import gc

    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def settled_heap():
    """`settle_heap()` for the block (a training loop in the driver), then `gc.unfreeze()`, so that
    a process running several runs (tests, sweeps) keeps no frozen heap between them."""
    import gc

    settle_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def spawn(cls: type, use_ray: bool, *args: Any, num_gpus: float = 0.0, **kwargs: Any) -> LocalHandle | RayHandle:
    """Instantiate `cls` in-process or as a Ray actor (one CPU each, so both fit a 2-core machine).
    num_gpus: the actor's share of a GPU. Ray hides every GPU from an actor that asks for none
    (CUDA_VISIBLE_DEVICES=""), so components on a GPU ask for a fraction and share it.
    Tensors cross Ray as raw bytes + dtype in both directions (miles.transport.ray_tensors): the
    actor installs the reducer when built, the driver here."""
    if not use_ray:
        return LocalHandle(cls(*args, **kwargs))
    import ray

    from miles.transport.ray_tensors import register, with_tensor_transport

    register()
    actor_cls = ray.remote(num_cpus=1, num_gpus=num_gpus)(with_tensor_transport(cls))
    return RayHandle(actor_cls.remote(*args, **kwargs), respawn=lambda: actor_cls.remote(*args, **kwargs))
