"""The FSDP2 trainer as one handle: `num_ranks` Ray actors in a placement group, one rank each.

    group = FSDPGroup(2, checkpoint_dir, algo, trainer_cfg, precision, temperature, device="cpu",
                      threads=1, seed=0, max_response_len=8)
    metrics = group.call("train_rl", batch)                      # rank 0's metrics
    weights, digest = group.submit("get_weights", num_returns=2)  # rank 0's futures
    group.call("save_state", path); group.call("load_state", path)
    group.shutdown()

It follows the calling convention of miles.orchestrate.handles (submit / get / call / apply), so the
loop drives it as it drives a RayHandle to a TorchTrainer: every call runs on every rank (the ranks
meet in collectives) with the same arguments, each rank picks its share of the batch
(miles.trainer.fsdp), and the caller gets rank 0's result. Arguments go into Ray's object store
once, whatever the number of ranks; tensors cross it as raw bytes (miles.transport.ray_tensors).
Start-up: rank 0's actor reports its node's IP and a free port there, then every rank builds its
FSDPTrainer, which joins the process group at that address.
"""

from __future__ import annotations

import socket
from typing import Any

from miles.transport.ray_tensors import with_tensor_transport

READY_TIMEOUT_S = 600.0  # a placement group that cannot be placed by then will not be (too few CPUs / GPUs)


class FSDPRank:
    """One rank's Ray actor: first where rank 0 listens, then the rank's trainer and calls into it."""

    def endpoint(self) -> tuple[str, int]:
        """This node's IP and a port free on it now (the process group binds it moments later)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, rank: int, world_size: int, master_addr: str, master_port: int, kwargs: dict) -> None:
        from miles.trainer.fsdp import FSDPTrainer

        self.trainer = FSDPTrainer(rank, world_size, master_addr, master_port, **kwargs)

    def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.trainer, method)(*args, **kwargs)

    def apply(self, fn: Any, *args: Any) -> Any:
        return fn(self.trainer, *args)


class FSDPGroup:
    in_process = False  # tensors cross Ray's object store, as with a RayHandle

    def __init__(self, num_ranks: int, checkpoint_dir: str, algo, cfg, precision, temperature: float = 1.0,
                 device: str = "cpu", threads: int | None = None, seed: int = 0, **trainer_kwargs: Any):
        """`num_ranks` ranks of FSDPTrainer(checkpoint_dir, algo, cfg, precision, temperature, device,
        threads, seed, **trainer_kwargs): TorchTrainer's arguments. Each rank's bundle: 1 CPU on the
        CPU, 1 GPU (and the CPU that drives it) on CUDA; Ray gives each GPU actor its own device."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from miles.transport.ray_tensors import register

        register()  # what the driver sends (batches) crosses as raw bytes too
        gpu = device != "cpu"
        bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
        self._placement = placement_group([bundle] * num_ranks, strategy="PACK")  # one host while it fits
        try:
            ray.get(self._placement.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self._placement)
            raise RuntimeError(f"Ray cannot place {num_ranks} trainer ranks of {bundle} each "
                               f"(cluster: {ray.cluster_resources()})") from None
        actor_cls = ray.remote(with_tensor_transport(FSDPRank))
        self.ranks = [actor_cls.options(num_cpus=1, num_gpus=1 if gpu else 0,
                                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                                            self._placement, placement_group_bundle_index=r)).remote()
                      for r in range(num_ranks)]
        self._pending: list = []  # ranks 1.. of earlier submits: waited for (and their errors raised) in get
        kwargs = dict(checkpoint_dir=checkpoint_dir, algo=algo, cfg=cfg, precision=precision, temperature=temperature,
                      device=device, threads=threads, seed=seed, **trainer_kwargs)
        try:
            master_addr, master_port = ray.get(self.ranks[0].endpoint.remote())
            self._wait([a.start.remote(r, num_ranks, master_addr, master_port, kwargs)
                        for r, a in enumerate(self.ranks)])
        except Exception:
            self.shutdown()  # the ranks that did start would wait for the others in the process group
            raise

    def submit(self, method: str, *args: Any, num_returns: int = 1, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` on every rank; rank 0's future (a list with num_returns > 1)."""
        import ray

        # Put once: every rank reads the same objects (a batch is not copied num_ranks times).
        args = [a if isinstance(a, ray.ObjectRef) else ray.put(a) for a in args]
        futures = [a.run.options(num_returns=num_returns).remote(method, *args, **kwargs) for a in self.ranks]
        for rest in futures[1:]:
            self._pending += rest if num_returns > 1 else [rest]
        return futures[0]

    def get(self, future: Any) -> Any:
        import ray

        # Taken off before waiting: a call that failed (a refusal on every rank, say) must not fail
        # every later call with its error again.
        pending, self._pending = self._pending, []
        self._wait([*pending, *(future if isinstance(future, list) else [future])])
        return ray.get(future)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.get(self.submit(method, *args, **kwargs))

    def apply(self, fn: Any, *args: Any) -> Any:
        """`fn(trainer, *args)` on every rank (a collective when fn is); rank 0's result."""
        futures = [a.apply.remote(fn, *args) for a in self.ranks]
        self._pending += futures[1:]
        return self.get(futures[0])

    def shutdown(self) -> None:
        """End the ranks' actors and free their placement group."""
        import ray

        for actor in self.ranks:
            ray.kill(actor, no_restart=True)
        ray.util.remove_placement_group(self._placement)

    @staticmethod
    def _wait(futures: list) -> None:
        """Until all are done; the first rank that failed raises at once: the others may be waiting
        for it in a collective and would never finish."""
        import ray

        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
