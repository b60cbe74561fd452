"""Hardware profiles (conf/hardware/) and the memory planner that refuses an OOM before launch.

    check_plan(cfg)   # prints the plan table for dry runs and refusals; raises PlanRefused (exit 3)
"""

from __future__ import annotations

from miles.config.errors import PlanRefused
from miles.config.schema import RunCfg, TrainerBackend
from miles.hardware.planner import Plan, make_plan


def check_plan(cfg: RunCfg) -> Plan:
    from miles.hardware.report import plan_table
    from miles.tracking.console import console

    plan = make_plan(cfg)
    split = _split_but_not_sharded(cfg, plan)
    if cfg.dry_run or not plan.fits or split:
        console.print(plan_table(cfg, plan))
    if not plan.fits:
        change = f"; change: {' or '.join(plan.suggestions)}" if plan.suggestions else ""
        raise PlanRefused("the run does not fit the hardware: " + "; ".join(plan.problems) + change)
    if split:
        raise PlanRefused(split)
    return plan


def _split_but_not_sharded(cfg: RunCfg, plan: Plan) -> str:
    """Why a launch cannot run a plan that fits only with the model split over GPUs (TP / PP / EP / CP),
    or "" where it can. No trainer backend runs model parallelism yet: trainer=torch and trainer=megatron
    hold the whole policy in one process (trainer=fsdp shards it over its ranks, which the plan does not
    model: not refused here). dry_run=true still shows such a plan, to size a cluster."""
    if cfg.dry_run or not plan.layout.model_parallel or cfg.trainer.backend == TrainerBackend.fsdp:
        return ""
    return (f"the run fits only with the model split over GPUs ({plan.layout.describe(plan.train_gpus)}), and "
            f"trainer={cfg.trainer.backend.value} holds the whole policy in one process: make it fit one GPU "
            "(trainer.recompute=true, smaller micro-batches, trainer.offload_optimizer=true, a smaller model) or "
            "shard it with trainer=fsdp trainer.num_ranks=<GPUs>; dry_run=true shows the plan")


__all__ = ["Plan", "check_plan", "make_plan"]
