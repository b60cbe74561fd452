"""One experiment, end to end: record -> initial weights -> components -> loop -> final checkpoint.

`launch.py` calls `run` with the validated RunCfg; so can a test or the GPU machine (with
`cfg.ray.enabled=False` the engine, the trainer and the critic run in-process). The loop runs under
`miles.orchestrate.supervise`: resume, checkpoints, signals, restarts of failed components.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, replace
from pathlib import Path

from miles.algo.registry import TOKEN_ADVANTAGES
from miles.config.hybrid_rules import hybrid_actor
from miles.config.schema import AlgoName, DType, RunCfg, SpeculativeKind
from miles.hardware.planner import resolve_memory_choices
from miles.data.rewards import build_scorer
from miles.data.source import PromptSource
from miles.data.tokenizer import TokenizerInfo
from miles.orchestrate import determinism
from miles.orchestrate.checkpoints import copy_tokenizer, draft_checkpoint, initial_checkpoint, teacher_checkpoint
from miles.orchestrate.debug import check_sync_tensors, rollout_hook
from miles.orchestrate.handles import settled_heap, spawn, start_ray
from miles.orchestrate.hybrid import HybridWorker, PartHandle
from miles.orchestrate.loop import LoopContext, rl_loop, sft_loop
from miles.orchestrate.prompting import adapter_routing, prompt_setup
from miles.orchestrate.resume import CheckpointStore
from miles.orchestrate.supervise import Stopped, supervise
from miles.rollout.engines import engine_backend
from miles.tracking.console import batch_table, console, step_line
from miles.tracking.journal import JournaledTracker
from miles.tracking.run_record import write_run_record
from miles.trainer.backends import TrainerStart, start_trainer
from miles.transport.protocol import TransportOptions, build_transport
from miles.types import Sample


def _samples_logger(tracker: JournaledTracker, limit: int):
    def log_samples(samples: list[Sample], step: int) -> None:
        rows = [
            {"step": step, "prompt": s.prompt, "response": s.response, "label": s.label, "reward": s.reward,
             **({"trajectory": s.info["trajectory"]} if "trajectory" in s.info else {})}
            for s in samples[:limit]
        ]
        if rows:
            tracker.log_table(rows, f"samples/step_{step:05d}.json")

    return log_samples


def run(cfg: RunCfg, run_dir: str | Path, overrides: list[str], resolved_yaml: str) -> float:
    """Returns the final held-out accuracy (the objective sweeps maximize)."""
    run_dir = Path(run_dir)
    cfg = resolve_memory_choices(cfg)  # null dense copies / offload keys: as the memory plan decides
    # Before anything is written: writable dirs, and a checkpoint to resume that fits this config.
    store = CheckpointStore.prepare(cfg, run_dir)
    if cfg.deterministic:
        determinism.enable(cfg.seed)  # before the warm start draws anything
    console.print(batch_table(cfg))
    record, git = write_run_record(run_dir, resolved_yaml, overrides, cfg.seed, cfg.deterministic)
    source = PromptSource(cfg.task, cfg.seed)
    adapters = adapter_routing(cfg, source)  # several LoRA adapters: every record names one (before the warm start)
    init_dir = initial_checkpoint(cfg, source, run_dir, log=console.print)
    tokenizer = TokenizerInfo.load(init_dir)
    prompt_format, multi_turn = prompt_setup(cfg, init_dir, source)  # before anything starts: the user's errors
    teacher_dir = teacher_checkpoint(cfg, init_dir, log=console.print)
    if teacher_dir is not None:
        console.print(f"distilling from the teacher in {teacher_dir}")
    draft_dir = draft_checkpoint(cfg, init_dir, run_dir, log=console.print)
    if draft_dir is not None:
        console.print(f"speculative rollout drafts with the model in {draft_dir}")

    run_name = cfg.tracking.run_name or f"{cfg.algo.name.value}-{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    tags = {
        "mlflow.source.git.commit": git["sha"] or "",
        "miles.run_dir": str(run_dir.absolute()),
        "miles.algo": cfg.algo.name.value,
        "miles.model": cfg.model.name,
    }
    if (resume_from := store.latest()) is not None:
        tags["miles.resumed_from"] = str(resume_from.absolute())
    tracker = JournaledTracker(cfg.tracking, run_name, tags, run_dir, log=console.print)
    tracker.log_params(asdict(cfg))
    for path in record.values():
        tracker.log_artifact(path, "run_record")
    run_id = tracker.run_id or "not created yet (journal only)"
    console.print(f"MLflow run {run_id} ({tracker.uri}); outputs in {run_dir}")

    def log(metrics: dict[str, float], step: int) -> None:
        tracker.log_metrics(metrics, step)
        console.print(step_line(step, cfg.steps, metrics))

    collect = rollout_hook(cfg)

    def build() -> LoopContext:
        engine, trainer, critic = _spawn_components(cfg, init_dir, teacher_dir, draft_dir)
        ctx = LoopContext(
            engine=engine, trainer=trainer, critic=critic, source=source, tokenizer=tokenizer,
            prompt_format=prompt_format, multi_turn=multi_turn, sft_target_key=cfg.task.label_key,
            reward_fn=build_scorer(cfg.task), log=log,
            on_samples=_samples_logger(tracker, cfg.tracking.log_samples),
            task_name=cfg.task.name, eval_max_new_tokens=cfg.eval.max_new_tokens, collect=collect,
            adapters=adapters,
        )
        if cfg.debug.compare_weights_tensorwise:
            ctx.after_sync = check_sync_tensors
        spec = cfg.rollout.speculative
        # A draft model's weights sync on their own; MTP weights travel with the policy's.
        ctx.draft_sync = spec.kind == SpeculativeKind.draft_model and spec.train_online
        if engine is not None and trainer is not None:  # debug.rollout_only / train_only: nothing to sync
            ctx.transport = build_transport(cfg.rollout.weight_sync, ctx,
                                            TransportOptions(bucket_mb=cfg.rollout.weight_sync_bucket_mb))
        return ctx

    if cfg.algo.name == AlgoName.sft:
        def loop(ctx):
            with settled_heap():
                return sft_loop(ctx, cfg.steps, cfg.trainer.global_batch_size, cfg.eval.interval)
    else:
        def loop(ctx):
            with settled_heap():  # the driver's start-up objects out of its full collections (handles.py)
                return rl_loop(ctx, cfg)

    use_ray = cfg.ray.enabled
    try:
        objective, ctx = supervise(cfg, store, build, loop, init_dir, {"mlflow_run_id": tracker.run_id},
                                   log=console.print)
        final = run_dir / "checkpoint"
        if ctx.trainer is not None:  # debug.rollout_only trains nothing
            ctx.trainer.call("save", str(final))
            copy_tokenizer(init_dir, final)
        tracker.log_metrics({"final/objective": objective}, cfg.steps)
        console.print(f"done: final held-out accuracy {objective:.3f}"
                      + (f"; checkpoint in {final}" if ctx.trainer is not None else ""))
        tracker.finish("FINISHED")
        return objective
    except Stopped as stop:
        tracker.finish("KILLED")
        console.print(f"{stop}; " + (f"checkpoint in {stop.checkpoint}: run the same command to resume"
                                     if stop.checkpoint else "nothing saved (debug mode)"))
        raise SystemExit(128 + stop.signum) from None
    except (KeyboardInterrupt, SystemExit):  # e.g. a second signal: no checkpoint, the run still closes
        tracker.finish("KILLED")
        raise
    except Exception:
        tracker.finish("FAILED")
        raise
    finally:
        if use_ray:
            import ray

            ray.shutdown()


def _spawn_components(cfg: RunCfg, init_dir: Path, teacher_dir: Path | None, draft_dir: Path | None = None):
    """The rollout engine, the trainer and (GAE advantages) the critic, as Ray actors (ray.enabled;
    the engine and the trainer in one where ray.hybrid applies) or in-process objects; the critic is
    None when the advantages need none, a `Critics` (one value model per adapter, one actor) with
    named LoRA adapters."""
    from miles.rollout.router import EngineFleet
    from miles.trainer.critic import Critics, TorchCritic

    use_ray, hw = cfg.ray.enabled, cfg.hardware
    with_critic = cfg.algo.advantage in TOKEN_ADVANTAGES
    engines = 0 if cfg.debug.train_only else cfg.rollout.num_engines
    ranks = 0 if cfg.debug.rollout_only else cfg.trainer.num_ranks
    actors = engines + ranks + with_critic
    if use_ray:
        start_ray(cfg.ray.address, cfg.ray.num_cpus,
                  runtime_env=determinism.ray_runtime_env(cfg.seed) if cfg.deterministic else None,
                  num_actors=max(actors, 2), worker_niceness=cfg.ray.worker_niceness)
    gpu = gpu_share(hw.device, max(actors, 2))
    # True on-policy: the engine holds the trainer's fp32 masters (synced as they are) and computes
    # under the trainer's autocast dtype, both sides with batch-invariant kernels.
    precision = replace(cfg.precision, rollout_dtype=DType.fp32) if cfg.true_on_policy else cfg.precision
    # debug.train_only runs without an engine, debug.rollout_only without a trainer.
    engine_cls, engine_options = engine_backend(cfg.rollout)
    draft = {"draft_dir": str(draft_dir)} if draft_dir is not None else {}
    if cfg.trainer.lora.rank > 0:  # syncs carry the adapters; every engine serves them (docs/lora.md)
        engine_options = {**engine_options, "lora": cfg.trainer.lora}
    engine_args = (str(init_dir), cfg.rollout, precision.rollout_dtype, hw.device, component_threads(cfg), cfg.seed)
    engine_kwargs = dict(precision=precision, max_slots=_kv_slots(cfg), record_routing=cfg.algo.routing_replay == "r3",
                         true_on_policy=cfg.precision.train_dtype if cfg.true_on_policy else None,
                         **engine_options, **draft)
    hybrid = hybrid_actor(cfg)
    fleet = [] if hybrid else [spawn(engine_cls, use_ray, *engine_args, num_gpus=gpu, **engine_kwargs)
                               for _ in range(engines)]
    # Several engines: one router in front (seeded per prompt group, so they sample as one engine).
    engine = None if not fleet else fleet[0] if len(fleet) == 1 else \
        EngineFleet(fleet, max_restarts=cfg.fault.max_retries, log=console.print)
    trainer_args = (str(init_dir), trainer_algo(cfg), cfg.trainer, precision, cfg.rollout.temperature, hw.device,
                    component_threads(cfg), cfg.seed)
    trainer_kwargs = dict(max_response_len=cfg.rollout.max_new_tokens, true_on_policy=cfg.true_on_policy,
                          teacher_dir=str(teacher_dir) if teacher_dir else None)
    if cfg.rollout.speculative.kind != SpeculativeKind.none and cfg.rollout.speculative.train_online:
        trainer_kwargs.update(speculative=cfg.rollout.speculative, **draft)  # validate(): a trainer that trains it

    def spawn_trainer(cls: type):
        if not hybrid:
            return spawn(cls, use_ray, *trainer_args, **trainer_kwargs, num_gpus=gpu)
        # One actor for both (ray.hybrid): the engine part is built first, as in-process.
        worker = spawn(HybridWorker, True, {"engine": (engine_cls, engine_args, engine_kwargs),
                                            "trainer": (cls, trainer_args, trainer_kwargs)}, num_gpus=2 * gpu)
        fleet.append(PartHandle(worker, "engine"))
        return PartHandle(worker, "trainer")

    trainer = None if cfg.debug.rollout_only else start_trainer(cfg.trainer.backend, TrainerStart(
        trainer_args, trainer_kwargs, cfg.trainer.num_ranks, spawn=spawn_trainer))
    if hybrid:
        engine = fleet[0]
    if len(fleet) > 1 and trainer is not None:  # an engine the fleet restarts when no sync went through it
        engine.weights_source = lambda: trainer.submit("get_weights", num_returns=2)
    critic = None
    if with_critic:
        critic_args = (str(init_dir), cfg.critic, cfg.trainer, cfg.precision, cfg.algo.num_steps_per_rollout,
                       hw.device, hw.cpu_threads, cfg.seed)
        # Several LoRA adapters: a critic each, as separate policies would have, in one component.
        adapters = list(cfg.trainer.lora.adapters) if cfg.trainer.lora.rank > 0 else []
        critic = spawn(Critics, use_ray, adapters, *critic_args, num_gpus=gpu) if adapters else \
            spawn(TorchCritic, use_ray, *critic_args, num_gpus=gpu)
    return engine, trainer, critic


def component_threads(cfg: RunCfg) -> int | None:
    """Torch threads of the engine and the trainer: hardware.cpu_threads, except in an asynchronous
    Ray run on the CPU, where the two compute at once in two processes and share the cores (each
    taking cpu_threads oversubscribes them: OpenMP threads spin; on 2 cores, benchmarks/scale_out.py
    measured a step at 3.9x the in-process one before this split, 1.25x with it)."""
    threads = cfg.hardware.cpu_threads
    if threads and cfg.rollout.asynchronous and cfg.ray.enabled and cfg.hardware.device == "cpu":
        return max(1, min(threads, (os.cpu_count() or 1) // 2))
    return threads


def trainer_algo(cfg: RunCfg):
    """cfg.algo with its defaults that depend on the rest of the run resolved. use_rollout_logprobs
    (null): an asynchronous run's batches come from a policy a step behind the trainer's, and PPO's
    ratio and clip against that behaviour policy keep its updates stable, where ratios against the
    trainer's own recomputed log-probs (1 at the first step) let them drift off (docs/scale-out.md)."""
    if cfg.algo.use_rollout_logprobs is None:
        behind = cfg.rollout.asynchronous and cfg.rollout.max_staleness > 0
        return replace(cfg.algo, use_rollout_logprobs=behind)
    return cfg.algo


def gpu_share(device: str, components: int) -> float:
    """Each Ray actor's share of the run's one GPU (colocated: they take turns on it); 0 on the CPU."""
    return 0.0 if device == "cpu" else 1.0 / components


def _kv_slots(cfg: RunCfg) -> int | None:
    """Sequences the planner's KV budget gives one engine (GPU slot decode sizes its cache by it)."""
    if cfg.hardware.device == "cpu":
        return None
    from miles.hardware.planner import make_plan

    return make_plan(cfg, suggest=False).kv_sequences or None
