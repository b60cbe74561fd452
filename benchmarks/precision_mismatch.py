"""Train / rollout mismatch of every precision recipe on the CPU tiny model, side by side.

    .venv/bin/python benchmarks/precision_mismatch.py --steps 20

Each recipe runs `launch.py precision=<recipe>` in-process (no Ray) from the same cached warm start
(qwen3_tiny, built once), with the same seed and step budget. The figure is
`mismatch/logprob_abs_diff`: the mean |trainer log-prob - rollout log-prob| over the sampled tokens,
averaged over the steps (read back from the run's MLflow store). Prints a Markdown table for
docs/precision.md. The pairs to compare: fp8 vs bf16_train_fp8_rollout (same engine, the trainer
sees the quantizer or not), int4_qat vs bf16_train_int4_rollout (QAT vs post-training quantization).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["fp32", "bf16", "fp8", "fp8,precision.fp8_scheme=w8a16", "bf16_train_fp8_rollout", "int4_qat",
           "bf16_train_int4_rollout"]


def run_recipe(recipe: str, steps: int, seed: int, store: str) -> dict:
    """`recipe`: a precision config name, optionally with overrides after commas
    (`fp8,precision.fp8_scheme=w8a16`)."""
    start = time.perf_counter()
    name, *overrides = recipe.split(",")
    experiment = recipe.replace(",", "+").replace("=", "-")  # '=' would end Hydra's override value
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), f"precision={name}", *overrides, f"steps={steps}", f"seed={seed}",
         "ray.enabled=false", f"eval.interval={steps}", f"tracking.uri={store}", f"tracking.experiment={experiment}",
         "tracking.log_samples=0"],
        cwd=ROOT, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"precision={recipe} failed:\n{proc.stderr[-2000:]}")
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    history = lambda key: [m.value for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                    key=lambda m: m.step)]
    accuracy = history("eval/arithmetic/accuracy")
    return {"recipe": recipe, "mismatch": statistics.mean(history("mismatch/logprob_abs_diff")),
            "first": accuracy[0], "last": accuracy[-1], "step_s": statistics.median(history("perf/step_time_s")),
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipes", nargs="*", default=RECIPES)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{tmp}/mlflow.db"
        rows = [run_recipe(r, args.steps, args.seed, store) for r in args.recipes]
    print("| recipe | mean mismatch/logprob_abs_diff | eval acc step 0 -> last | median step s |")
    print("|---|---:|---|---:|")
    for row in rows:
        print(f"| {row['recipe']} | {row['mismatch']:.2e} | {row['first']:.3f} -> {row['last']:.3f} | {row['step_s']:.2f} |")


if __name__ == "__main__":
    main()
