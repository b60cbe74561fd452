"""Hardware profiles (conf/hardware/) and the memory planner that refuses an OOM before launch.

    check_plan(cfg)   # prints the plan table for dry runs and refusals; raises PlanRefused (exit 3)
"""

from __future__ import annotations

from miles.config.errors import PlanRefused
from miles.config.schema import RunCfg, TrainerBackend
from miles.hardware.footprint import param_groups
from miles.hardware.planner import GB, Plan, make_plan, model_arch, train_usage


def check_plan(cfg: RunCfg) -> Plan:
    from miles.hardware.report import plan_table
    from miles.tracking.console import console

    plan = make_plan(cfg)
    unrunnable = _not_runnable(cfg, plan)
    if cfg.dry_run or not plan.fits or unrunnable:
        console.print(plan_table(cfg, plan))
    if not plan.fits:
        change = f"; change: {' or '.join(plan.suggestions)}" if plan.suggestions else ""
        raise PlanRefused("the run does not fit the hardware: " + "; ".join(plan.problems) + change)
    if unrunnable:
        raise PlanRefused(unrunnable)
    return plan


def _not_runnable(cfg: RunCfg, plan: Plan) -> str:
    """Why a launch cannot run a plan that fits, or "". The plan sizes Megatron-style training: the model
    split over GPUs (TP / PP / EP / CP) and the optimizer state sharded over data-parallel ones. No
    trainer backend splits the model yet, and trainer=torch / trainer=megatron train in one process on
    one GPU: there the training state must fit one GPU. (trainer=fsdp shards it over its ranks, which
    the plan does not model: not refused here.) dry_run=true still shows such a plan, to size a cluster."""
    one_process = cfg.trainer.backend in (TrainerBackend.torch, TrainerBackend.megatron)
    if cfg.dry_run or cfg.hardware.device == "cpu" or not one_process:
        return ""
    change = ("make it fit one GPU (trainer.recompute=true, smaller micro-batches, trainer.offload_optimizer=true, a "
              "smaller model) or shard it with trainer=fsdp trainer.num_ranks=<GPUs>; dry_run=true shows the plan")
    backend = f"trainer={cfg.trainer.backend.value} trains in one process on one GPU"
    if plan.layout.model_parallel:
        return f"the run fits only with the model split over GPUs ({plan.layout.describe(plan.train_gpus)}), and {backend}: {change}"
    if plan.train_gpus > 1:
        groups = param_groups(model_arch(cfg), cfg.precision)
        needed = sum(train_usage(cfg, groups, plan.layout, 1).values())
        if needed > plan.capacity:
            return (f"the run fits only with the optimizer state sharded over {plan.train_gpus} GPUs, and {backend}, "
                    f"where training needs {needed / GB:,.1f} GB of {plan.capacity / GB:,.1f} usable: {change}")
    return ""


__all__ = ["Plan", "check_plan", "make_plan"]
