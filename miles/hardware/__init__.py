"""Hardware profiles (conf/hardware/) and the memory planner that refuses an OOM before launch.

    check_plan(cfg)   # prints the plan table for dry runs and refusals; raises PlanRefused (exit 3)
"""

from __future__ import annotations

from miles.config.errors import PlanRefused
from miles.config.schema import RunCfg
from miles.hardware.planner import Plan, make_plan


def check_plan(cfg: RunCfg) -> Plan:
    from miles.hardware.report import plan_table
    from miles.tracking.console import console

    plan = make_plan(cfg)
    if cfg.dry_run or not plan.fits:
        console.print(plan_table(cfg, plan))
    if not plan.fits:
        change = f"; change: {' or '.join(plan.suggestions)}" if plan.suggestions else ""
        raise PlanRefused("the run does not fit the hardware: " + "; ".join(plan.problems) + change)
    return plan


__all__ = ["Plan", "check_plan", "make_plan"]
