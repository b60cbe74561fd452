"""GRPO step breakdown on one GPU: the real loop (`launch.py`, in-process), per precision recipe.

    python benchmarks/grpo_step.py [--recipes bf16 fp8] [--steps 4] [--model qwen3_0_6b] [--modes sync async]
    python benchmarks/grpo_step.py --recipes bf16 fp8,precision.forward_weights=rollout   # a recipe with overrides

Each recipe runs `launch.py hardware=gpu ray.enabled=false model=<model> warm_start.enabled=false
precision=<recipe> rollout.max_new_tokens=256 steps=<steps> checkpoint.enabled=false` (64 prompts x 8 samples, random
weights: responses run to the 256-token budget) and reads the per-step `perf/*` metrics from the
run's journal. Step 1 includes first-use costs (kernel selection, compiles) and is reported apart;
the table gives the median of the later steps. "train / sync turn s" is the colocation moves' time
(`perf/train_turn_s`, within train s; `perf/sync_turn_s`, outside sync s: the offloads and resumes
around it), the sync turn's parts after it: the trainer's offloads, the engine's weights back, its
cache back with the decode graphs captured again; "eval s" the evaluation of the last step, outside
both. `--modes sync async` runs each recipe also with
`rollout.asynchronous=true` (batch k+1 generated while step k trains; its rollout time is hidden,
so the step time is what to compare).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["perf/step_time_s", "perf/rollout_time_s", "perf/train_time_s", "perf/weight_sync_s",
        "rollout/tokens_per_s", "mismatch/logprob_abs_diff", "perf/peak_mem_rollout_gb", "perf/peak_mem_train_gb",
        "perf/peak_mem_sync_gb", "perf/train_turn_s", "perf/sync_turn_s", "perf/sync_turn_trainer_s",
        "perf/sync_turn_weights_s", "perf/sync_turn_cache_s", "perf/eval_time_s"]


def median_of_present(steps: list[dict], key: str) -> float:
    """The median of `key` over the steps that logged it (evaluation steps only for eval time; no
    peaks and turns in an asynchronous run); nan where none did."""
    values = [m[key] for m in steps if key in m]
    return statistics.median(values) if values else math.nan


def run(spec: str, model: str, steps: int, work: Path, mode: str = "sync") -> dict[int, dict]:
    """spec: a recipe name, optionally with overrides after commas (fp8,precision.forward_weights=rollout)."""
    recipe, *overrides = spec.split(",")
    out = work / f"{len(list(work.glob('*_*')))}_{recipe}_{mode}"
    cmd = [sys.executable, str(ROOT / "launch.py"), "hardware=gpu", "ray.enabled=false", f"model={model}",
           "warm_start.enabled=false", f"precision={recipe}", *overrides, "rollout.max_new_tokens=256", f"steps={steps}",
           "eval.interval=1000", "task.eval_size=16",
           "checkpoint.enabled=false", f"tracking.uri=sqlite:///{work}/mlflow.db",
           f"hydra.run.dir={out}", *(["rollout.asynchronous=true"] if mode == "async" else [])]
    subprocess.run(cmd, check=True, cwd=work)
    metrics: dict[int, dict] = {}
    for line in (out / "mlflow" / "journal.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry["op"] == "metrics":
            metrics.setdefault(entry["step"], {}).update(entry["metrics"])
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--model", default="qwen3_0_6b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["sync"], choices=["sync", "async"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for recipe in args.recipes:
            for mode in args.modes:
                metrics = run(recipe, args.model, args.steps, Path(work), mode)
                later = [metrics[s] for s in range(2, args.steps + 1)]
                label = recipe if args.modes == ["sync"] else f"{recipe} {mode}"
                rows.append((label, {k: median_of_present(later, k) for k in KEYS}, metrics[1]["perf/step_time_s"]))
                print(f"# {label}: {rows[-1][1]} (step 1: {rows[-1][2]:.1f} s, mismatch "
                      f"{metrics[1]['mismatch/logprob_abs_diff']:.3e})", flush=True)  # kept if a later run fails
    print("| recipe | step s | rollout s | train s | sync s | rollout tok/s | logprob mismatch | step 1 s "
          "| peak GB rollout / train / sync | train / sync turn s (trainer, weights, cache) | eval s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|")
    for recipe, m, first in rows:
        print(f"| {recipe} | {m['perf/step_time_s']:.2f} | {m['perf/rollout_time_s']:.2f} | {m['perf/train_time_s']:.2f} "
              f"| {m['perf/weight_sync_s'] * 1e3:.0f} ms | {m['rollout/tokens_per_s']:,.0f} "
              f"| {m['mismatch/logprob_abs_diff']:.2e} | {first:.1f} "
              f"| {m['perf/peak_mem_rollout_gb']:.1f} / {m['perf/peak_mem_train_gb']:.1f} "
              f"/ {m['perf/peak_mem_sync_gb']:.1f} | {m['perf/train_turn_s']:.2f} / {m['perf/sync_turn_s']:.2f} "
              f"({m['perf/sync_turn_trainer_s']:.2f}, {m['perf/sync_turn_weights_s']:.2f}, "
              f"{m['perf/sync_turn_cache_s']:.2f}) "
              f"| {m['perf/eval_time_s']:.2f} |")


if __name__ == "__main__":
    main()
