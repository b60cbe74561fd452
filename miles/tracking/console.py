"""Console output of a run: the effective batch table at start, one progress line per step."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from miles.algo.registry import TOKEN_ADVANTAGES
from miles.config.schema import AlgoName, RunCfg

console = Console(highlight=False, soft_wrap=True)


def batch_table(cfg: RunCfg) -> Table:
    r, t, a = cfg.rollout, cfg.trainer, cfg.algo
    table = Table(title=f"Effective batch ({a.name.value})", show_header=True)
    table.add_column("quantity")
    table.add_column("key")
    table.add_column("value", justify="right")
    if a.name == AlgoName.sft:
        rows = [
            ("examples per optimizer step", "trainer.global_batch_size", t.global_batch_size),
            ("micro-batch size", "trainer.micro_batch_size", t.micro_batch_size),
            ("gradient accumulation steps", "global / micro", t.global_batch_size // t.micro_batch_size),
            ("optimizer steps", "steps", cfg.steps),
        ]
    else:
        rows = [
            ("prompts per step", "rollout.batch_size", r.batch_size),
            ("samples per prompt", "rollout.n_samples_per_prompt", r.n_samples_per_prompt),
            ("samples per step", "batch_size * n_samples", r.batch_size * r.n_samples_per_prompt),
            ("sequences per optimizer step", "trainer.global_batch_size", t.global_batch_size),
            ("optimizer steps per rollout", "algo.num_steps_per_rollout", a.num_steps_per_rollout),
            ("micro-batch size", "trainer.micro_batch_size", t.micro_batch_size),
            ("gradient accumulation steps", "global / micro", t.global_batch_size // t.micro_batch_size),
            ("RL steps", "steps", cfg.steps),
        ]
        if a.advantage in TOKEN_ADVANTAGES:
            rows += [
                ("critic passes per rollout", "critic.updates_per_step", cfg.critic.updates_per_step),
                ("critic-only warm-up steps", "critic.warmup_steps", cfg.critic.warmup_steps),
            ]
    for name, key, value in rows:
        table.add_row(name, key, str(value))
    return table


def step_line(step: int, total: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step:>4}/{total}"]
    for key, label, fmt in (
        ("rollout/reward_mean", "reward", "{:.3f}"),
        ("rollout/tool_call_rate", "tool calls", "{:.2f}"),
        ("train/loss", "loss", "{:+.4f}"),
        ("critic/value_loss", "value loss", "{:.4f}"),
        ("train/reverse_kl", "reverse kl", "{:+.4f}"),
        ("mismatch/logprob_abs_diff", "mismatch", "{:.3e}"),  # recipes differ in the 3rd digit
        ("perf/step_time_s", "time", "{:.2f}s"),
    ):
        if key in metrics:
            parts.append(f"{label} " + fmt.format(metrics[key]))
    evals = [f"eval {k.split('/')[1]} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/")
             and k.endswith("/accuracy")]
    evals += [f"eval tool calls {v:.2f}" for k, v in metrics.items() if k.startswith("eval/") and
              k.endswith("/tool_call_rate")]
    return " | ".join(parts + evals)
