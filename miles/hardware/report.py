"""The planner's answer as a table: per-device memory of each side, the layout, and the verdict."""

from __future__ import annotations

from rich.table import Table

from miles.config.schema import RunCfg
from miles.hardware.planner import GB, Plan, model_arch
from miles.hardware.vision_footprint import tower_params


def plan_table(cfg: RunCfg, plan: Plan) -> Table:
    hw, device = cfg.hardware, "device" if cfg.hardware.device == "cpu" else "GPU"
    verdict = "[green]fits[/green]" if plan.fits else "[red]refused[/red]"
    title = (f"Memory plan: model={cfg.model.name} precision={cfg.precision.name} hardware={hw.name} "
             f"({plan.gpus} {device}{'s' if plan.gpus > 1 else ''}, {plan.capacity / GB:,.1f} GB usable each "
             f"after a {hw.memory_margin:.0%} margin): {verdict}")
    table = Table(title=title, title_justify="left")
    table.add_column("side")
    table.add_column("item")
    table.add_column(f"GB per {device}", justify="right")
    table.add_column("how")
    layout = plan.layout.describe(plan.train_gpus) if hw.device != "cpu" else "single process"
    qlora = cfg.trainer.lora.rank > 0 and cfg.precision.train_quant.value != "none"
    if qlora:
        held = f"frozen base in {cfg.precision.train_quant.value} (QLoRA), adapters fp32"
    else:
        held = f"{cfg.precision.train_dtype.value} compute copy"
    how = {"weights": f"{held}; {layout}",
           "gradients": "fp32 accumulation",
           "optimizer": ("fp32 master; the AdamW moments in host memory (trainer.offload_optimizer)"
                         if plan.layout.offload else "AdamW moments (+ fp32 master), sharded over data parallel"),
           "activations": plan.micro_batch.how + (", recomputed" if cfg.trainer.recompute else ""),
           "logits": "fp32 logits and their gradient",
           "reference": "frozen reference policy (algo.kl_coef > 0)",
           "critic": "value model: weights, gradients, optimizer"}
    if plan.images is not None:
        vision = _vision_how(cfg, plan)
        how.update(vision, weights=f"{how['weights']}; {vision['weights']}")
    for item, value in plan.train.items():
        table.add_row("train", item, f"{value / GB:,.2f}", how.get(item, ""))
    table.add_row("train", "[bold]total[/bold]", f"[bold]{plan.train_total / GB:,.2f}[/bold]",
                  f"on {plan.train_gpus} {device}s" if hw.device != "cpu" else "")
    quant = cfg.precision.rollout_quant.value
    fmt = cfg.precision.rollout_dtype.value if quant == "none" else f"{quant} (+ scales)"
    engines = max(1, plan.rollout_gpus // plan.gpus_per_engine)
    table.add_row("rollout", "weights", f"{plan.rollout['weights'] / GB:,.2f}",
                  f"{fmt}; {engines} engine(s) x {plan.gpus_per_engine} {device}(s)")
    table.add_row("rollout", "workspace", f"{plan.rollout['workspace'] / GB:,.2f}", "decode activations, buffers")
    if "dense copies" in plan.rollout:
        table.add_row("rollout", "dense copies", f"{plan.rollout['dense copies'] / GB:,.2f}",
                      f"the quantized weights dequantized to {cfg.precision.rollout_dtype.value}, for calls of > 256 rows")
    for item in ("vision weights", "vision activations"):
        if item in plan.rollout:
            table.add_row("rollout", item, f"{plan.rollout[item] / GB:,.2f}", how[f"rollout {item}"])
    kv_note = (f"holds {plan.kv_sequences:,} sequences of "
               f"{cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens} tokens; "
               f"{plan.sequences_per_engine:,} per engine per step")
    if plan.images is not None and plan.images.merged:
        kv_note += f"; {plan.images.merged:,} image tokens per prompt among them"
    if 0 < plan.kv_sequences < plan.sequences_per_engine:
        kv_note += " (generated in waves)"
    table.add_row("rollout", "KV cache", "rest", kv_note)
    mode = (_colocation(plan) if plan.colocated and hw.device != "cpu"
            else "same RAM, both resident" if hw.device == "cpu" else
            f"disaggregated: {plan.train_gpus} train + {plan.rollout_gpus} rollout GPUs")
    table.caption = mode
    if plan.host_needed:
        table.caption += f"; host memory per node {plan.host_needed / GB:,.0f} GB"
    for problem in plan.problems:
        table.add_row("[red]refused[/red]", "", "", problem)
    for suggestion in plan.suggestions:
        table.add_row("[yellow]change[/yellow]", "", "", suggestion)
    return table


def _vision_how(cfg: RunCfg, plan: Plan) -> dict[str, str]:
    """The vision tower's share of the items (miles/hardware/vision_footprint.py), and where the
    image size comes from."""
    params = tower_params(model_arch(cfg))
    state = "frozen: weights only" if cfg.trainer.freeze_vision else "trained: gradients and optimizer state too"
    source = plan.images.source
    return {"weights": f"the vision tower's {params:,} parameters included ({state})",
            "vision activations": f"ViT over the micro-batch's images, attention masks (patches^2); {source}",
            "rollout vision weights": f"the tower's {params:,} parameters in {cfg.precision.rollout_dtype.value}",
            "rollout vision activations": f"one tower call over a generate call's prompts; {source}"}


def _colocation(plan) -> str:
    """What each side gives back during the other's turn on a colocated GPU (as the plan decided it)."""
    released = [side for side, off in zip(("engine", "trainer"), plan.offload) if off]
    if not released:
        return "colocated: both sides resident (rollout.offload / trainer.offload off)"
    return f"colocated: the {' and the '.join(released)} offloaded during the other's turn"
