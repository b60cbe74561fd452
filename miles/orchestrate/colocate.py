"""Colocation memory phases (`rollout.offload`, `trainer.offload`): on a GPU the engine and the
trainer take turns on the same device, and the side whose turn it is not gives its memory back.

    phases = MemoryPhases(ctx, cfg)   # rl_loop builds it; a no-op on the CPU and with both keys off
    phases.start()                    # before the first rollout: the trainer leaves the device
    phases.train_turn()               # after a rollout: the engine releases, the trainer comes back
    seconds = phases.sync()           # after training: weights to the engine, the trainer leaves again

The order keeps the peak of each phase to one side's memory (the call order of the components'
methods, miles/rollout/native.py `release_memory` and miles/trainer/torch_trainer.py `offload`):

    rollout        engine resident; trainer parameters, gradients and optimizer state in host memory
    train_turn     engine: release weights (dropped: the next sync reloads them) and KV cache
                   trainer: onload
    sync           trainer: offload gradients and optimizer state; engine: resume weights;
                   weight sync; trainer: offload parameters; engine: resume KV cache (CUDA graphs
                   captured again)

`phase_memory` reads the device peak of a phase (`perf/peak_mem_rollout_gb`, `perf/peak_mem_train_gb`,
`perf/peak_mem_sync_gb`) in every process that holds a component (once where both share one), and
sums them. Each window opens when its phase begins: the train window after the engine released (a
window opened before it starts at the engine's whole allocation: on an H100 the 4B step's train
"peak" read 68.2 GB, the rollout's allocation), the rollout window after the sync. The moves take
time too: `perf/train_turn_s` (the release and onload, within `perf/train_time_s`) and
`perf/sync_turn_s` (the offloads and resumes around the sync, outside `perf/weight_sync_s`; split
into the trainer's offloads, the engine's weights and its cache with the graph capture).
"""

from __future__ import annotations

import time

from miles.orchestrate.sync import sync_weights
from miles.transport.device import memory_stats


def _peak(component, reset: bool) -> int:
    """The device peak of this component's process since the last reset (bytes); starts a new window."""
    return memory_stats(component.device, reset_peak=reset).peak


def phase_memory(ctx) -> float:
    """GB: the device peak since the last call, summed over the processes of the engine and the
    trainer (one, in-process), and a new window opened."""
    handles = [h for h in (ctx.engine, ctx.trainer) if h is not None]
    if all(getattr(h, "in_process", False) for h in handles) or \
            (len(handles) == 2 and getattr(handles[1], "same_process", lambda other: False)(handles[0])):
        handles = handles[:1]  # one process (in-process, or one Ray actor: ray.hybrid), one allocator
    peaks = [sum(h.apply_all(_peak, True)) if hasattr(h, "apply_all") else h.apply(_peak, True) for h in handles]
    return sum(peaks) / 2**30


class MemoryPhases:
    def __init__(self, ctx, cfg):
        gpu = cfg.hardware.device != "cpu"
        self.ctx, self.check = ctx, cfg.rollout.check_weight_sync
        self.engine = gpu and cfg.rollout.offload and ctx.engine is not None
        self.trainer = gpu and cfg.trainer.offload and ctx.trainer is not None
        # Phases overlap in an asynchronous run: no peak of one phase to read.
        self.measure = gpu and ctx.engine is not None and ctx.trainer is not None and not cfg.rollout.asynchronous

    @property
    def engine_released(self) -> bool:
        """The engine's weights leave it at each train turn: every step syncs, updated or not."""
        return self.engine

    def start(self) -> None:
        if self.trainer:
            self.ctx.trainer.call("offload")
        if self.measure:
            phase_memory(self.ctx)  # opens the first rollout's window

    def train_turn(self) -> dict[str, float]:
        metrics = {"perf/peak_mem_rollout_gb": phase_memory(self.ctx)} if self.measure else {}
        start = time.perf_counter()
        if self.engine:
            self.ctx.engine.call("release_memory", keep_weights=False)
        if self.trainer:
            self.ctx.trainer.call("onload")
        if self.engine or self.trainer:  # part of perf/train_time_s
            metrics["perf/train_turn_s"] = time.perf_counter() - start
        if self.measure:  # the train window opens now, without the memory the engine just gave back
            phase_memory(self.ctx)
        return metrics

    def sync(self) -> tuple[float, dict[str, float]]:
        """The weight sync of a step with its phases: (seconds of the sync, the train phase's and the
        sync's peaks, and the moves around the sync, outside its seconds: `perf/sync_turn_s` in all,
        of it `perf/sync_turn_trainer_s` (the trainer's offloads), `perf/sync_turn_weights_s` (the
        engine's weights back) and `perf/sync_turn_cache_s` (its slot cache back and its CUDA graphs
        captured again))."""
        metrics = {"perf/peak_mem_train_gb": phase_memory(self.ctx)} if self.measure else {}
        moves = {"perf/sync_turn_trainer_s": 0.0, "perf/sync_turn_weights_s": 0.0, "perf/sync_turn_cache_s": 0.0}

        def move(key: str, component, *args) -> None:
            start = time.perf_counter()
            component.call(*args)
            moves[key] += time.perf_counter() - start

        if self.trainer:
            move("perf/sync_turn_trainer_s", self.ctx.trainer, "offload", ("grads", "optimizer"))
        if self.engine:
            move("perf/sync_turn_weights_s", self.ctx.engine, "resume_memory", ("weights",))
        seconds = sync_weights(self.ctx, self.check)
        if self.trainer:
            move("perf/sync_turn_trainer_s", self.ctx.trainer, "offload", ("params",))
        if self.engine:
            move("perf/sync_turn_cache_s", self.ctx.engine, "resume_memory", ("kv_cache",))
        if self.engine or self.trainer:
            metrics.update(moves, **{"perf/sync_turn_s": sum(moves.values())})
        if self.measure:  # the sync's own peak (both sides hold weights); the rollout window opens after it
            metrics["perf/peak_mem_sync_gb"] = phase_memory(self.ctx)
        return seconds, metrics
